"""multiloss against the hand-written loop it replaces: time per batch, peak memory, same weights after.

    python benchmarks/speed.py                           # CPU, 1 thread, every recipe, fp32
    python benchmarks/speed.py --device cuda --precision bf16-mixed
    python benchmarks/speed.py --recipes gan tbptt --rounds 7 --batches 300
    python benchmarks/speed.py --compile                 # model.compile=true against the eager loop

Per recipe, one process runs, interleaved over ``--rounds`` rounds:

- **plain**: the seeds' loop in plain PyTorch (below, one function per recipe) on the same network
  object, initial weights, data loader (so the same order) and optimizer the recipe builds;
- **off**: ``multiloss.train(cfg)`` with ``logger=none callbacks=none``, no progress bar, model
  summary or checkpointing (what multiloss always adds stays: RNG states, run record, non-finite guard, leak check);
- **defaults**: ``multiloss.train(cfg)`` with the shipped logger and callbacks.

Validation is off in all three (``trainer.limit_val_batches=0``): this measures training. Time is
the wall time from the end of batch ``--warmup`` to the end of batch ``--warmup + --batches``
(a batch is one ``training_step``: a micro-batch under accumulation, a whole sequence of chunks in
tbptt), per batch; the table gives the median over rounds. Everything a batch costs is in it:
loading, the step, hooks, logging, epoch ends. Peak memory is ``torch.cuda.max_memory_allocated``
on CUDA, the largest resident set size seen at a batch end on CPU. ``max |Δw|`` compares every
weight after the last timed batch with the plain loop's: 0 means the same arithmetic, bit for bit.

A benchmark, not a test: timings move with the machine's load; read the ratios, rerun to compare.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hydra.utils import instantiate  # noqa: E402

from multiloss.batches import as_dict  # noqa: E402
from multiloss.testing import compose  # noqa: E402
from multiloss.training import build_data_and_model, train  # noqa: E402

RECIPES = ("multihead", "weighted", "gan", "tbptt", "accumulation")
# Batches timed per run (after the warm-up): a few epochs of digits, a fraction of the GAN's and tbptt's.
BATCHES = {"multihead": 200, "weighted": 200, "gan": 200, "tbptt": 40, "accumulation": 200}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Window:
    """The timed stretch of one run: the batches ending after batch ``warmup``, ``batches`` of them."""

    warmup: int
    batches: int
    device: torch.device
    seen: int = 0
    stamps: list[float] = field(default_factory=list)  # perf_counter at each batch end from batch `warmup` on
    peak: int = 0
    done: bool = False

    def begin(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def batch_ended(self) -> bool:
        """Count a batch; True when the window is complete (the loop should stop)."""
        self.seen += 1
        if self.device.type == "cpu":
            self.peak = max(self.peak, rss_bytes())
        if self.seen >= self.warmup:
            if self.seen == self.warmup and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.stamps.append(time.perf_counter())
        if self.seen == self.warmup + self.batches:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                self.stamps[-1] = time.perf_counter()
                self.peak = torch.cuda.max_memory_allocated(self.device)
            self.done = True
        return self.done

    @property
    def median_ms(self) -> float:
        """The typical batch: robust to a noisy machine; leaves out the rare batch that ends an epoch."""
        return 1e3 * statistics.median(b - a for a, b in itertools.pairwise(self.stamps))

    @property
    def mean_ms(self) -> float:
        """Everything, epoch ends (loader restarts, epoch-end hooks, checkpoints) included."""
        return 1e3 * (self.stamps[-1] - self.stamps[0]) / self.batches


class StepTimer(L.Callback):
    """Times the recipe's batches (`Window`), stops the run after the window and keeps the final weights."""

    # train() builds the timer from the config (+callbacks.bench_timer): the window goes in, the timer out, here.
    window: Window | None = None
    current: StepTimer | None = None

    def __init__(self) -> None:
        self.window = StepTimer.window
        self.weights: dict[str, torch.Tensor] = {}
        StepTimer.current = self

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.window.begin()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.window.batch_ended() and not self.weights:
            self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            trainer.should_stop = True


# --- the plain loops: what the seeds write, one per recipe ------------------------------------------


def batches(loader: Any, device: torch.device) -> Iterator[tuple[int, int, bool, dict[str, torch.Tensor]]]:
    """(epoch, index, last of the epoch, batch on device), forever; the sampler reshuffles per epoch."""
    for epoch in itertools.count():
        loader.sampler.set_epoch(epoch)
        n = len(loader)
        for i, batch in enumerate(loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in as_dict(batch).items()}
            yield epoch, i, i + 1 == n, batch


def multihead_loop(nets, cfg, loader, device, window, autocast) -> None:
    net = nets["net"]
    opt = instantiate(cfg.model.optimizer)(net.parameters())
    for _, _, _, batch in batches(loader, device):
        with autocast():
            loss = sum(F.cross_entropy(logits, batch["y"]) for logits in net(batch["x"]))
        opt.zero_grad()
        loss.backward()  # one backward of the summed heads
        opt.step()
        if window.batch_ended():
            return


def weighted_loop(nets, cfg, loader, device, window, autocast) -> None:
    net = nets["net"]
    tasks = cfg.model.tasks
    loss_fns = {name: instantiate({"_target_": "hydra.utils.get_method", "path": t.loss}) for name, t in tasks.items()}
    weights = torch.tensor([float(t.weight) for t in tasks.values()], device=device)
    opt = instantiate(cfg.model.optimizer)(net.parameters())
    for _, _, _, batch in batches(loader, device):
        with autocast():
            outputs = net(batch["x"])
            losses = torch.stack([loss_fns[n](outputs[n], batch[t.target]) for n, t in tasks.items()])
        opt.zero_grad()
        torch.autograd.backward(losses, grad_tensors=weights.to(losses.dtype))  # the seeds' grad_tensors
        opt.step()
        if window.batch_ended():
            return


def gan_loop(nets, cfg, loader, device, window, autocast) -> None:
    G, D = nets["generator"], nets["discriminator"]
    m = cfg.model
    opt_g = instantiate(m.g_optimizer)(G.parameters())
    opt_d = instantiate(m.d_optimizer)(D.parameters())
    epochs = cfg.trainer.max_epochs
    decay = functools.partial(lambda e, n: max(0.0, 1 - e / n), n=epochs)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, decay) for o in (opt_g, opt_d)]
    noise = torch.Generator(device=device).manual_seed(m.noise_seed)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.randn(n, m.latent_dim + 1, generator=noise, device=device)
        return rows[:, :-1], torch.special.ndtr(rows[:, -1:])

    current = 0
    for epoch, i, _, batch in batches(loader, device):
        if epoch != current:
            for s in schedules:
                s.step()
            current = epoch
        real = batch["x"]
        with autocast():
            z, eps = draw(len(real))
            fake = G(z).detach()
            loss_d = -D(real).mean() + D(fake).mean()
            x_hat = (eps * real + (1 - eps) * fake).requires_grad_(True)
            (grad,) = torch.autograd.grad(D(x_hat).sum(), x_hat, create_graph=True)
            loss_d = loss_d + m.gp_weight * ((grad.flatten(1).norm(2, dim=1) - 1) ** 2).mean()
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
        if (i + 1) % m.n_critic == 0:
            with autocast():
                z, _ = draw(len(real))
                loss_g = -D(G(z)).mean()
            opt_g.zero_grad()
            loss_g.backward()
            opt_g.step()
        if window.batch_ended():
            return


def tbptt_loop(nets, cfg, loader, device, window, autocast) -> None:
    net = nets["net"]
    m = cfg.model
    opt = instantiate(m.optimizer)(net.parameters())
    for _, _, _, batch in batches(loader, device):
        hidden = None
        for x, y in zip(batch["x"].split(m.chunk_length, 1), batch["y"].split(m.chunk_length, 1)):
            with autocast():
                logits, hidden = net(x, hidden)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), m.gradient_clip_val)
            opt.step()
            hidden = tuple(h.detach() for h in hidden)  # the seeds' repackage_hidden
        if window.batch_ended():
            return


def accumulation_loop(nets, cfg, loader, device, window, autocast) -> None:
    net = nets["net"]
    k = cfg.trainer.accumulate_grad_batches
    opt = instantiate(cfg.model.optimizer)(net.parameters())
    for group in opt.param_groups:  # the linear rule: lr × (batch × k) / base batch
        group["lr"] *= cfg.data.batch_size * k / cfg.model.base_batch_size
    for _, i, last, batch in batches(loader, device):
        with autocast():
            loss = F.cross_entropy(net(batch["x"]), batch["y"]) / k  # the seeds' loss / accumulation_steps
        loss.backward()
        if (i + 1) % k == 0 or last:
            opt.step()
            opt.zero_grad()
        if window.batch_ended():
            return


PLAIN: dict[str, Callable[..., None]] = {
    "multihead": multihead_loop,
    "weighted": weighted_loop,
    "gan": gan_loop,
    "tbptt": tbptt_loop,
    "accumulation": accumulation_loop,
}
NETS = {"gan": ("generator", "discriminator")}


# --- one run of each kind ------------------------------------------------------------------------


@dataclass
class Result:
    ms: list[float] = field(default_factory=list)  # per run: the median batch
    mean_ms: list[float] = field(default_factory=list)  # per run: all batches, epoch ends included
    peak: list[int] = field(default_factory=list)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)


def overrides(args: argparse.Namespace, recipe: str, mode: str) -> list[str]:
    accelerator = "gpu" if args.device == "cuda" else "cpu"
    common = [
        f"recipe={recipe}",
        f"trainer.accelerator={accelerator}",
        "trainer.devices=1",
        f"trainer.precision={args.precision}",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        "print_config=false",
        "overwrite=true",
        *args.override,
    ]
    if args.compile:
        common.append("model.compile=true")
    if mode == "off":
        common += [
            "logger=none",
            "callbacks=none",
            "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false",
            "+trainer.enable_checkpointing=false",
        ]
    return [*common, f"+callbacks.bench_timer._target_={StepTimer.__module__}.StepTimer"]


def run_recipe(args: argparse.Namespace, recipe: str, mode: str, out: Path) -> tuple[Window, dict]:
    cfg = compose(*overrides(args, recipe, mode), output_dir=out)
    window = StepTimer.window = Window(args.warmup, args.batches or BATCHES[recipe], torch.device(args.device))
    # The progress bar draws as usual, into /dev/null: the table is this script's output.
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        train(cfg)
    return window, StepTimer.current.weights


def run_plain(args: argparse.Namespace, recipe: str, out: Path) -> tuple[Window, dict]:
    cfg = compose(*overrides(args, recipe, "off"), output_dir=out)
    device = torch.device(args.device)
    datamodule, module = build_data_and_model(cfg)  # the same seed, so the same initial weights
    module.to(device)
    datamodule.setup("fit")
    nets = {name: getattr(module, name) for name in NETS.get(recipe, ("net",))}
    window = Window(args.warmup, args.batches or BATCHES[recipe], device)
    if args.precision == "bf16-mixed":
        autocast = functools.partial(torch.autocast, device_type=args.device, dtype=torch.bfloat16)
    else:
        autocast = _no_autocast
    window.begin()
    if args.compile:
        nets = {name: torch.compile(net) for name, net in nets.items()}
    PLAIN[recipe](nets, cfg, datamodule.train_dataloader(), device, window, autocast)
    return window, {k: v.detach().clone() for k, v in module.state_dict().items()}


class _no_autocast:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    common = [k for k in a if k in b and a[k].is_floating_point()]
    if not common:
        return math.nan
    return max((a[k].float() - b[k].float()).abs().max().item() for k in common)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed"))
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=10, help="batches before the timed window")
    parser.add_argument("--batches", type=int, default=0, help="timed batches per run (default: per recipe)")
    parser.add_argument("--modes", nargs="+", default=["off", "defaults"], choices=("off", "defaults"))
    parser.add_argument("--compile", action="store_true", help="model.compile=true (and torch.compile the plain nets)")
    parser.add_argument("--override", nargs="*", default=[], help="extra config overrides for every run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    import warnings

    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    print(machine(args))
    print()
    print(header(args.modes))
    with tempfile.TemporaryDirectory(prefix="multiloss-bench-") as tmp:
        for recipe in args.recipes:
            results = {kind: Result() for kind in ("plain", *args.modes)}
            for r in range(args.rounds):
                for kind in results:
                    out = Path(tmp) / f"{recipe}-{kind}-{r}"
                    if kind == "plain":
                        window, weights = run_plain(args, recipe, out)
                    else:
                        window, weights = run_recipe(args, recipe, kind, out)
                    results[kind].ms.append(window.median_ms)
                    results[kind].mean_ms.append(window.mean_ms)
                    results[kind].peak.append(window.peak)
                    results[kind].weights = weights
            print(row(recipe, results, args.modes), flush=True)


def row(recipe: str, results: dict[str, Result], modes: list[str]) -> str:
    plain = statistics.median(results["plain"].ms)
    plain_all = statistics.median(results["plain"].mean_ms)
    cells = [recipe, f"{plain:.2f}"]
    for kind in modes:
        ms, all_ms = statistics.median(results[kind].ms), statistics.median(results[kind].mean_ms)
        cells += [f"{ms:.2f}", f"**{ms / plain:.2f}×**", f"{all_ms / plain_all:.2f}×"]
    cells += [f"{max(results[kind].peak) / 2**20:.0f}" for kind in results]
    cells += [f"{largest_difference(results[kind].weights, results['plain'].weights):.0e}" for kind in modes]
    return "| " + " | ".join(cells) + " |"


def header(modes: list[str]) -> str:
    names = ["recipe", "plain ms"]
    for kind in modes:
        names += [f"{kind} ms", f"{kind} ratio", f"{kind} ratio, all batches"]
    names += [f"peak MiB {kind}" for kind in ("plain", *modes)]
    names += [f"max abs Δw {kind}" for kind in modes]
    return "| " + " | ".join(names) + " |\n|---|" + "---:|" * (len(names) - 1)


def machine(args: argparse.Namespace) -> str:
    if args.device == "cuda":
        where = torch.cuda.get_device_name()
    else:
        where = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} torch thread(s)"
    return (
        f"Machine: {where}; torch {torch.__version__}, lightning {L.__version__}, Python "
        f"{platform.python_version()}; precision {args.precision}{', compiled' if args.compile else ''}; "
        f"{args.rounds} rounds, median; {args.warmup} warm-up batches."
    )


if __name__ == "__main__":
    main()
