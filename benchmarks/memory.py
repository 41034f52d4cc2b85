"""The memory laws the recipes rest on, measured: each case in a fresh process, on CPU or CUDA.

    python benchmarks/memory.py                    # CPU: every law
    python benchmarks/memory.py --device cuda
    python benchmarks/memory.py --laws tbptt validation heads
    python benchmarks/memory.py --laws sharding [--device cuda]

- **tbptt**: truncated BPTT's peak memory is flat in the sequence length (one chunk's graph at a
  time), full BPTT's grows with it. ``recipe=tbptt`` through ``multiloss.train``, one batch of 4
  sequences of ``data.seq_len`` 1k … 32k characters, ``model.chunk_length=32`` against
  ``model.chunk_length=<seq_len>`` (one backward through the whole sequence).
- **accumulation**: k micro-batches of B/k hold about 1/k of the activations of one batch of B.
  ``recipe=accumulation`` with a wide MLP (width 2048, depth 4), B = 1024, k = 1, 2, 4, 8.
- **validation**: tbptt's validation over continuous streams is flat in the streams' length (window by
  window, chunk by chunk, the state carried), where one forward over each whole stream holds logits of
  streams × length × vocabulary. ``recipe=tbptt`` on ``data=npz`` token streams, a 15k vocabulary, 10
  validation streams of 1.5k … 12k tokens (``Trainer.validate``), against that one forward (the
  recipe's net, no gradient) up to the length this machine holds.
- **heads**: N heads' losses summed and backpropagated once cost about one backward, in time and
  memory, against N ``backward(retain_graph=True)`` calls (plain PyTorch, a trunk of 6 dense blocks of
  width 1024 and N linear heads, batch 256).
- **sharding**: under FSDP2 (``trainer=fsdp_cpu`` / ``trainer=fsdp``) each of 2 ranks holds half of the
  parameters, gradients and optimizer state that a DDP rank holds whole (law: sharded bytes a rank =
  DDP's / world size, up to the parameters no unit shards). ``recipe=multihead`` (Adam) on a trunk of
  6 × 4096 dense blocks (84 M parameters), 2 ranks, batch 512 a rank, with and without activation
  checkpointing of the blocks (``model.fsdp.checkpoint=[Sequential]``), and with ``balancer=pcgrad`` (the
  net held whole for its step: its parameters gathered and each head's whole gradient; with
  ``model.balancer.scope=global``, the rule on the shards); per rank: the bytes of its
  parameters, gradients (at the optimizer step) and optimizer state, its peak resident memory (CPU) or
  ``torch.cuda.max_memory_allocated`` (CUDA), and the median step time.

Memory is measured above what the process held just before the first training step (weights,
data, the framework): on CUDA ``torch.cuda.max_memory_allocated`` minus ``memory_allocated`` then;
on CPU the peak resident set size (``ru_maxrss``) minus the resident size then, with glibc told to
map every allocation of 64 KiB or more on its own (``MALLOC_MMAP_THRESHOLD_``), so that a freed
tensor leaves the resident set at once and the peak is the peak of live memory. Each case runs in
its own process, so no case inherits another's peak. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAWS = ("tbptt", "validation", "accumulation", "heads", "sharding")
SEQ_LENS = (1024, 4096, 16384, 32768)
FULL_BPTT_SEQ_LENS = (1024, 4096, 16384)  # 32k full BPTT holds ~2.5 GB of graph: slow on a small CPU
ACCUMULATION_K = (1, 2, 4, 8)
HEADS = (1, 2, 4, 8)
VOCAB, VAL_STREAMS = 15_000, 10
VAL_LENGTHS = (1536, 3072, 6144, 12288)
WHOLE_FORWARD_LENGTHS = (1536, 3072, 6144)  # 12k: 7.2 GB of logits alone
# (width, depth, batch a rank, dense blocks' extras): a wide trunk, whose training state dominates (84 M parameters,
# 1.3 GB with Adam's state), and a deep narrow one at a large batch, with BatchNorm and dropout, whose activations
# do (each block keeps four tensors for the backward; checkpointed, only its input).
# (width, depth, batch a rank, overrides, what the row is, whether to checkpoint the blocks in a third row)
SHARDED_NETS = (
    (4096, 6, 1024, (), "", True),
    (1024, 16, 2048, ("model.net.batch_norm=true", "model.net.dropout=0.1"), " (BN, dropout)", True),
    # A gradient balancer: the net held whole for its step (one autograd.grad a head, 3 heads).
    (4096, 3, 512, ("balancer=pcgrad",), ", PCGrad", False),
    # The rule on the shards: each head's gradient reduce-scattered, never a whole weight or gradient.
    (4096, 3, 512, ("balancer=pcgrad", "model.balancer.scope=global"), ", PCGrad global", False),
)
SHARDED_STEPS = 4


# --- inside a case's process ----------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Meter:
    """Memory above the level when `start` was called: peak allocation (CUDA) or peak RSS (CPU)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.base = 0

    def start(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = _rss()

    def peak_above(self) -> int:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.base


class SavedBytes:
    """Bytes autograd keeps for backward (the activations), live and peak, each storage counted once.

    Weights that an operation saves (a Linear keeps its weight for the input's gradient) are not
    counted: they live anyway.

    Through ``torch.autograd.graph.saved_tensors_hooks``: the exact activation memory, on any device.
    (A benchmark only: with the hooks on, autograd stops checking saved tensors for in-place changes.)
    """

    def __init__(self) -> None:
        self.live: dict[tuple[object, int], list[int]] = {}  # storage -> [references, bytes]
        self.now = self.peak = 0

    def hooks(self):
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor):
        import weakref

        base = tensor if tensor._base is None else tensor._base
        if base.is_leaf and base.requires_grad:  # a weight (or its transpose) saved for backward: not an activation
            return _Saved(tensor)
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        entry = self.live.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.now += entry[1]
            self.peak = max(self.peak, self.now)
        entry[0] += 1
        holder = _Saved(tensor)
        weakref.finalize(holder, self._release, key)
        return holder

    @staticmethod
    def unpack(holder):
        return holder.tensor

    def _release(self, key: tuple[object, int]) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.live[key]


class _Saved:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor) -> None:
        self.tensor = tensor


def run_recipe_case(device: str, overrides: list[str]) -> dict[str, float]:
    """``multiloss.train`` on ``overrides``; the peak above the memory held at the first batch's start."""
    sys.path.insert(0, str(ROOT))  # multiloss as installed (see speed.py)
    import lightning as L
    import torch

    from multiloss.testing import compose
    from multiloss.training import train

    torch.set_num_threads(1)
    meter = Meter(device)

    class StartMeter(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 0 and batch_idx == 0:
                meter.start()
                self.t = time.perf_counter()

    Meter.callback = StartMeter  # built by train() from the config below
    accelerator = "gpu" if device == "cuda" else "cpu"
    with tempfile.TemporaryDirectory() as out:
        cfg = compose(
            *overrides,
            f"trainer.accelerator={accelerator}",
            "trainer.devices=1",
            "logger=none",
            "callbacks=none",
            "+trainer.enable_checkpointing=false",
            "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false",
            "trainer.limit_val_batches=0",
            "trainer.num_sanity_val_steps=0",
            "print_config=false",
            f"+callbacks.meter._target_={__name__}.Meter.callback",
            output_dir=out,
        )
        saved = SavedBytes()
        start = time.perf_counter()
        with saved.hooks():
            train(cfg)
        seconds = time.perf_counter() - start
    return {"peak": meter.peak_above(), "saved": saved.peak, "seconds": seconds}


def run_validation_case(device: str, length: int, whole: bool) -> dict[str, float]:
    """Validation of ``VAL_STREAMS`` streams of ``length`` tokens: the recipe's, or one forward per whole stream."""
    sys.path.insert(0, str(ROOT))  # multiloss as installed (see speed.py)
    import lightning as L
    import numpy as np
    import torch
    import torch.nn.functional as F

    from multiloss.data.streams import batchify
    from multiloss.testing import build, compose

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    meter = Meter(device)
    with tempfile.TemporaryDirectory() as out:
        files = {"train": Path(out) / "train.npz", "val": Path(out) / "val.npz"}
        np.savez(files["train"], x=rng.integers(0, VOCAB, 20_000), vocab_size=np.int64(VOCAB))
        np.savez(files["val"], x=rng.integers(0, VOCAB, VAL_STREAMS * length + 1), vocab_size=np.int64(VOCAB))
        cfg = compose(
            "recipe=tbptt",
            "data=npz",
            f"data.path={files['train']}",
            f"data.val_path={files['val']}",
            "data.layout=streams",
            "data.batch_size=10",
            f"data.val_batch_size={VAL_STREAMS}",
            "data.seq_len=35",
            "model.chunk_length=35",
            output_dir=out,
        )
        datamodule, module = build(cfg)
        module = module.to(device)
        start = time.perf_counter()
        if whole:
            rows = batchify(datamodule.streams.ids["val"], VAL_STREAMS).to(device)
            meter.start()
            with torch.no_grad():
                logits, _ = module.net(rows[:, :-1], None)
                F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        else:

            class StartMeter(L.Callback):
                def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
                    if batch_idx == 0:
                        meter.start()

            L.Trainer(
                accelerator="gpu" if device == "cuda" else "cpu",
                devices=1,
                logger=False,
                callbacks=[StartMeter()],
                enable_progress_bar=False,
                enable_model_summary=False,
            ).validate(module, datamodule=datamodule, verbose=False)
        seconds = time.perf_counter() - start
    return {"peak": meter.peak_above(), "saved": 0, "seconds": seconds}


def run_heads_case(device: str, heads: int, summed: bool, repeats: int = 5) -> dict[str, float]:
    """One training step's backward of ``heads`` heads: summed once, or one retain_graph backward each."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from multiloss.nets import dense_blocks

    torch.set_num_threads(1)
    torch.manual_seed(0)
    trunk = nn.Sequential(*dense_blocks(256, 1024, 6, 0.0, False)).to(device)
    head_nets = nn.ModuleList(nn.Linear(1024, 10) for _ in range(heads)).to(device)
    x = torch.randn(256, 256, device=device)
    y = torch.randint(0, 10, (256,), device=device)
    meter, saved = Meter(device), SavedBytes()
    times = []
    for i in range(repeats + 1):
        if i == 1:
            meter.start()  # after a first step: allocator warm, gradients allocated
        start = time.perf_counter()
        with saved.hooks():
            features = trunk(x)
            losses = [F.cross_entropy(head(features), y) for head in head_nets]
        if summed:
            sum(losses).backward()
        else:
            for j, loss in enumerate(losses):
                loss.backward(retain_graph=j < len(losses) - 1)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"peak": meter.peak_above(), "saved": saved.peak, "seconds": statistics.median(times[1:])}


class ShardMeter:
    """A callback (built by Lightning in each rank of a ``train.py`` run) writing ``<out>_rank<r>.json``: the bytes
    of the rank's parameters, gradients and optimizer state (a sharded tensor's local shard), its peak memory, the
    memory at the first step's start and its median step time."""

    def __new__(cls, out: str):
        import lightning as L

        class _Meter(L.Callback):
            def __init__(self) -> None:
                self.grads = 0
                self.times: list[float] = []

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if trainer.global_step == 0 and batch_idx == 0:
                    self.device = "cuda" if pl_module.device.type == "cuda" else "cpu"
                    self.meter = Meter(self.device)
                    self.meter.start()
                    self.backward = 0
                self._sync()
                self.step_base = _reset_peak(self.device)
                self.t = time.perf_counter()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self._sync()
                self.times.append(time.perf_counter() - self.t)

            def on_before_optimizer_step(self, trainer, pl_module, optimizer):
                # After the forward and backward, before the update: their peak above the step's start.
                self.backward = max(self.backward, _peak_since_reset(self.device) - self.step_base)
                grads = sum(_local_bytes(p.grad) for p in pl_module.parameters() if p.grad is not None)
                self.grads = max(self.grads, grads)

            def on_train_end(self, trainer, pl_module):
                import torch

                optimizer_state = sum(
                    _local_bytes(v)
                    for opt in trainer.optimizers
                    for state in opt.state.values()
                    for v in state.values()
                    if isinstance(v, torch.Tensor)
                )
                peak = (
                    torch.cuda.max_memory_allocated()
                    if self.device == "cuda"
                    else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                )
                result = {
                    "params": sum(_local_bytes(p) for p in pl_module.parameters()),
                    "numel": sum(p.numel() for p in pl_module.parameters()),  # the whole model's, sharded or not
                    "grads": self.grads,
                    "optimizer": optimizer_state,
                    "peak": peak,
                    "peak_above_start": self.meter.peak_above(),
                    "backward": self.backward,
                    "seconds": statistics.median(self.times[1:]),
                }
                Path(f"{out}_rank{trainer.global_rank}.json").write_text(json.dumps(result))

            def _sync(self) -> None:
                import torch

                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    torch.cuda.synchronize()

        return _Meter()


def _reset_peak(device: str) -> int:
    """Start a new peak (CUDA's allocation peak; on CPU the kernel's VmHWM, reset through clear_refs); the memory
    now."""
    import torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    Path("/proc/self/clear_refs").write_text("5")
    return _rss()


def _peak_since_reset(device: str) -> int:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
    return local.numel() * local.element_size()


def run_sharded_case(
    device: str, trainer: str, checkpointed: bool, width: int, depth: int, batch: int, extras: tuple[str, ...]
) -> dict[str, list[dict[str, float]]]:
    """``train.py recipe=multihead`` on 2 ranks under ``trainer`` (ddp_cpu, fsdp_cpu, ddp, fsdp); each rank's
    numbers."""
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "meter"
        # Random digits-shaped examples, enough for every step's full batch on both ranks (digits has 1,437).
        n = int(2 * batch * SHARDED_STEPS / 0.8) + 2
        rng = np.random.default_rng(0)
        data = Path(tmp) / "data.npz"
        np.savez(data, x=rng.standard_normal((n, 64), dtype=np.float32), y=rng.integers(0, 10, n))
        proc = subprocess.run(
            [
                sys.executable,
                str(ROOT / "train.py"),
                "recipe=multihead",
                "data=npz",
                f"data.path={data}",
                *extras,
                f"model.net.width={width}",
                f"model.net.depth={depth}",
                f"data.batch_size={batch}",
                f"trainer={trainer}",
                "trainer.devices=2",
                f"trainer.max_steps={SHARDED_STEPS}",
                "trainer.limit_val_batches=0",
                "trainer.num_sanity_val_steps=0",
                "trainer.enable_progress_bar=false",
                "trainer.enable_model_summary=false",
                "+trainer.enable_checkpointing=false",
                "logger=none",
                "callbacks=none",
                "print_config=false",
                *(["model.fsdp.checkpoint=[Sequential]"] if checkpointed else []),
                "+callbacks.meter._target_=memory.ShardMeter",
                f"+callbacks.meter.out={out}",
                f"hydra.run.dir={tmp}/run",
            ],
            capture_output=True,
            text=True,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")]),
                "PYTHONWARNINGS": "ignore",
                "OMP_NUM_THREADS": "1",
                "MALLOC_MMAP_THRESHOLD_": "65536",
            },
        )
        if proc.returncode != 0:
            raise RuntimeError(f"sharded case {trainer} failed:\n{proc.stderr[-3000:]}")
        return {"ranks": [json.loads(Path(f"{out}_rank{r}.json").read_text()) for r in (0, 1)]}


def sharding_law(device: str) -> None:
    trainers = ("ddp", "fsdp") if device == "cuda" else ("ddp_cpu", "fsdp_cpu")
    print(
        "\n**Sharding**: recipe=multihead (Adam), a trunk of depth × width dense blocks, 2 ranks. MiB a rank (rank 0):"
    )
    print("parameters + gradients + optimizer state = the training state (the law: FSDP2's = DDP's / 2); forward +")
    print("backward: the peak of a step's forward and backward above the step's start (activations, gradients,")
    print("FSDP2's gathered units); peak: the rank's (CPU: resident set; CUDA: max_memory_allocated), and above the")
    print("first step's start\n")
    print(
        "| trunk, batch a rank | trainer | activation checkpointing | parameters | gradients | optimizer "
        "| training state | × DDP's | forward + backward | peak | peak above start | s / step |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for width, depth, batch, extras, label, with_checkpointing in SHARDED_NETS:
        state_ddp = None
        runs = ((trainers[0], False), (trainers[1], False), *(((trainers[1], True),) if with_checkpointing else ()))
        for trainer, checkpointed in runs:
            r = run_sharded_case(device, trainer, checkpointed, width, depth, batch, extras)["ranks"][0]
            state = r["params"] + r["grads"] + r["optimizer"]
            state_ddp = state_ddp or state
            print(
                f"| {depth} × {width}{label}, {r['numel'] / 1e6:.1f} M, {batch} "
                f"| {trainer} "
                f"| {'blocks' if checkpointed else 'off'} | {mib(r['params'])} | {mib(r['grads'])} "
                f"| {mib(r['optimizer'])} | {mib(state)} | {state / state_ddp:.3f} | {mib(r['backward'])} "
                f"| {mib(r['peak'])} | {mib(r['peak_above_start'])} | {r['seconds']:.2f} |",
                flush=True,
            )


# --- the driver: one subprocess per case ------------------------------------------------------------


def case(device: str, kind: str, *args: str) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, __file__, "--case", kind, "--device", device, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"case {kind} {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def both(result: dict[str, float]) -> str:
    """'saved for backward / process peak above the start', MiB."""
    return f"{mib(result['saved'])} / {mib(result['peak'])}"


def tbptt_law(device: str) -> None:
    print("\n**TBPTT**: one batch of 4 sequences (pydoc text); MiB saved for backward at most / peak above the start\n")
    print("| data.seq_len | chunk_length=32 (truncated) | chunk_length=seq_len (full BPTT) |")
    print("|---:|---:|---:|")
    for seq_len in SEQ_LENS:
        common = ["recipe=tbptt", f"data.seq_len={seq_len}", "data.batch_size=4", "trainer.max_epochs=1"]
        # One batch: seq_len / 32 chunk steps truncated, one step full.
        chunks = seq_len // 32
        truncated = case(device, "recipe", *common, "model.chunk_length=32", f"trainer.max_steps={chunks}")
        full = (
            both(case(device, "recipe", *common, f"model.chunk_length={seq_len}", "trainer.max_steps=1"))
            if seq_len in FULL_BPTT_SEQ_LENS
            else "(not run)"
        )
        print(f"| {seq_len} | {both(truncated)} | {full} |", flush=True)


def validation_law(device: str) -> None:
    print(f"\n**Validation**: {VAL_STREAMS} streams of L tokens, a {VOCAB:,}-word vocabulary, the recipe's LSTM")
    print("(char_lstm: embedding 48, hidden 192); MiB peak above the start, seconds\n")
    print("| L (tokens a stream) | recipe: window by window | one forward over each whole stream |")
    print("|---:|---:|---:|")
    for length in VAL_LENGTHS:
        windowed = case(device, "validation", str(length), "windowed")
        whole = case(device, "validation", str(length), "whole") if length in WHOLE_FORWARD_LENGTHS else None
        print(
            f"| {length:,} | {mib(windowed['peak'])} MiB, {windowed['seconds']:.1f} s | "
            + (f"{mib(whole['peak'])} MiB, {whole['seconds']:.1f} s |" if whole else "(not run) |"),
            flush=True,
        )


def accumulation_law(device: str) -> None:
    print("\n**Accumulation**: 1024 examples per optimizer step as k micro-batches of 1024/k, MLP width 2048 depth 4,")
    print("MiB saved for backward at most (the activations) and peak above the start (gradients, the same for every k,")
    print("included)\n")
    print("| k | micro-batch | saved for backward | vs k=1 | peak above start |")
    print("|---:|---:|---:|---:|---:|")
    first = None
    for k in ACCUMULATION_K:
        result = case(
            device,
            "recipe",
            "recipe=accumulation",
            f"data.batch_size={1024 // k}",
            f"model.accumulate_grad_batches={k}",
            "model.net.width=2048",
            "model.net.depth=4",
            "trainer.max_steps=3",
        )
        first = first or result["saved"]
        print(
            f"| {k} | {1024 // k} | {mib(result['saved'])} | {result['saved'] / first:.3f} | {mib(result['peak'])} |",
            flush=True,
        )


def heads_law(device: str) -> None:
    print("\n**Heads**: N heads on one trunk (6 × 1024 dense, batch 256): Σ losses, one backward vs N")
    print("backward(retain_graph=True); forward + backward time (median of 5);")
    print("MiB saved for backward / peak above start\n")
    print("| N | summed ms | retain_graph ms | time ratio | summed MiB | retain_graph MiB |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in HEADS:
        summed = case(device, "heads", str(n), "summed")
        retained = case(device, "heads", str(n), "retained")
        print(
            f"| {n} | {summed['seconds'] * 1e3:.1f} | {retained['seconds'] * 1e3:.1f} "
            f"| {retained['seconds'] / summed['seconds']:.2f}× | {both(summed)} | {both(retained)} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--laws", nargs="+", default=list(LAWS), choices=LAWS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.case == "recipe":
        print(json.dumps(run_recipe_case(args.device, rest)))
        return
    if args.case == "validation":
        print(json.dumps(run_validation_case(args.device, int(rest[0]), rest[1] == "whole")))
        return
    if args.case == "heads":
        print(json.dumps(run_heads_case(args.device, int(rest[0]), rest[1] == "summed")))
        return
    import torch

    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.machine()}, {os.cpu_count()} cores"
    print(f"Machine: {where}; torch {torch.__version__}; 1 torch CPU thread; fp32.")
    for law in args.laws:
        laws = {
            "tbptt": tbptt_law,
            "validation": validation_law,
            "accumulation": accumulation_law,
            "heads": heads_law,
            "sharding": sharding_law,
        }
        laws[law](args.device)


if __name__ == "__main__":
    main()
