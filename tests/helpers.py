"""Test-only tools shared by the recipe proofs (the public ones live in `multiloss.testing`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from multiloss.parallel.ddp import ddp_wrappers


class AllReduceCounter(L.Callback):
    """Counts DDP's gradient all-reduces (a comm hook on every DDP wrapper) and the optimizer steps.

    Writes ``allreduce_rank<r>.json`` into ``dirpath`` when training ends, one file per rank, so a
    test can read what happened inside real DDP processes.
    """

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath
        self.allreduces = 0
        self.steps = 0

    def on_train_start(self, trainer, pl_module) -> None:
        model = trainer.strategy.model
        wrappers = [model] if isinstance(model, DistributedDataParallel) else list(ddp_wrappers(pl_module).values())
        assert wrappers, "no DDP wrapper: run this under a DDP strategy"
        for wrapper in wrappers:
            wrapper.register_comm_hook(state=None, hook=self._hook)

    def _hook(self, state, bucket):
        self.allreduces += 1
        return allreduce_hook(dist.group.WORLD, bucket)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.steps += 1

    def on_train_end(self, trainer, pl_module) -> None:
        path = Path(self.dirpath) / f"allreduce_rank{trainer.global_rank}.json"
        path.write_text(json.dumps({"allreduces": self.allreduces, "optimizer_steps": self.steps}))


class ReduceScatterCounter(L.Callback):
    """Counts FSDP2's gradient reduce-scatters (one a sharded unit a backward that syncs) and the optimizer steps.

    Writes ``reducescatter_rank<r>.json`` (reduces, optimizer steps, sharded units) into ``dirpath`` at the end.
    Wraps torch's ``foreach_reduce``, what each FSDP2 parameter group calls to reduce-scatter its gradients.
    """

    def __init__(self, dirpath: str) -> None:
        self.dirpath, self.reduces, self.steps = dirpath, 0, 0

    def on_train_start(self, trainer, pl_module) -> None:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

        self.units = sum(
            1 for m in pl_module.modules() if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group
        )
        original = group.foreach_reduce

        def counted(*args, **kwargs):
            self.reduces += 1
            return original(*args, **kwargs)

        group.foreach_reduce = counted

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.steps += 1

    def on_train_end(self, trainer, pl_module) -> None:
        counts = {"reduces": self.reduces, "optimizer_steps": self.steps, "units": self.units}
        (Path(self.dirpath) / f"reducescatter_rank{trainer.global_rank}.json").write_text(json.dumps(counts))


class TrainedExamples(L.Callback):
    """Appends the ``id`` of every example this rank trains on, batch by batch (``{"epoch", "ids"}`` a line), to
    ``<dirpath>/trained_rank<r>.jsonl``: what the training step was handed, not what the loader's workers fetched."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        line = {"epoch": trainer.current_epoch, "ids": batch["id"].tolist()}
        with (Path(self.dirpath) / f"trained_rank{trainer.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")


# Examples that carry their own id, for the proofs that each is trained once (`write_id_data`).
ID_EXAMPLES = 200  # examples in the file; 160 train (val_fraction 0.2)
ID_TRAIN = 160


def write_id_data(path: Path) -> Path:
    """Digits-shaped examples with an ``id`` column (npz serves every array as a batch key), at ``path``."""
    rng = np.random.default_rng(0)
    x, y = rng.random((ID_EXAMPLES, 64)).astype(np.float32), np.arange(ID_EXAMPLES) % 10
    # weighted's digit tasks read parity and ink as the digits data serves them
    np.savez(path, x=x, y=y, parity=(y % 2).astype(np.float32), ink=x.mean(1), id=np.arange(ID_EXAMPLES))
    return path


def recording_ids(id_data: Path, record: Path) -> tuple[str, ...]:
    """Overrides that train on ``id_data`` and record every trained example's id into ``record``."""
    record.mkdir(parents=True, exist_ok=True)
    return (
        "data=npz",
        f"data.path={id_data}",
        "+callbacks.ids._target_=tests.helpers.TrainedExamples",
        f"+callbacks.ids.dirpath={record}",
    )


def epoch_orders(epochs: int, seed: int = 0) -> dict[int, list[int]]:
    """Each epoch's permutation of `write_id_data`'s training examples, as their ids (the training examples are the
    split's: the file's rows in the order of data.split_seed=0, the first 40 held out for validation)."""
    from multiloss.data.order import EpochOrder

    train_ids = np.random.default_rng(0).permutation(ID_EXAMPLES)[ID_EXAMPLES - ID_TRAIN :]
    order = EpochOrder(ID_TRAIN, world_size=1, rank=0, batch_size=1, shuffle=True, seed=seed, drop_last=False)
    return {epoch: train_ids[order.permutation(epoch).numpy()].tolist() for epoch in range(epochs)}


class BalancerStartState(L.Callback):
    """Saves the balancer's state each rank starts training from (after a resume: what it restored) to
    ``<dirpath>/<name>_balancer_rank<r>.pt``."""

    def __init__(self, dirpath: str, name: str = "run") -> None:
        self.dirpath, self.name = dirpath, name

    def on_train_start(self, trainer, pl_module) -> None:
        from multiloss.balancers.protocol import unpack_state

        state = unpack_state(pl_module.balancer.get_extra_state())
        torch.save(state, Path(self.dirpath) / f"{self.name}_balancer_rank{trainer.global_rank}.pt")


def started_balancer_states(dirpath: Path, name: str) -> list:
    """What `BalancerStartState` saved for the run ``name``, by rank."""
    paths = sorted(Path(dirpath).glob(f"{name}_balancer_rank*.pt"))
    return [torch.load(path, weights_only=True) for path in paths]


def balancer_states(checkpoint: Path) -> list:
    """The balancer's states a checkpoint holds: every rank's (a per-rank rule on several ranks) or its one."""
    from multiloss.balancers.protocol import PER_RANK, unpack_state

    state_dict = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    state = unpack_state(state_dict["balancer._extra_state"])
    return state[PER_RANK] if isinstance(state, dict) and PER_RANK in state else [state]


def trained_examples(dirpath: Path) -> dict[int, list[int]]:
    """Every id `TrainedExamples` recorded in ``dirpath`` (all ranks, all runs that wrote there), by epoch."""
    seen: dict[int, list[int]] = {}
    for path in sorted(Path(dirpath).glob("trained_rank*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            seen.setdefault(record["epoch"], []).extend(record["ids"])
    return seen


def straight_and_resumed(
    make_cfg: Callable, tmp_path: Path, common: Iterable[str], stop: str, end: str
) -> tuple[Path, Path, Path]:
    """Three real runs: straight to ``end``; to ``stop``; and from that run's ``last.ckpt`` on to ``end``.

    ``stop`` and ``end`` are overrides (``trainer.max_steps=12``); returns the run dirs
    ``(straight, first, resumed)``, so a test compares what the resume must have kept.
    """
    from multiloss import train

    common = tuple(common)
    straight, first, resumed = tmp_path / "straight", tmp_path / "first", tmp_path / "resumed"
    train(make_cfg(*common, end, output_dir=straight))
    train(make_cfg(*common, stop, output_dir=first))
    train(make_cfg(*common, end, f"ckpt_path={first / 'checkpoints/last.ckpt'}", output_dir=resumed))
    return straight, first, resumed


class DieOnRank(L.Callback):
    """Kills this process (exit code 3, no cleanup, as a crash or an OOM kill would) on ``rank`` at ``step``."""

    def __init__(self, rank: int = 1, step: int = 2) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step >= self.step:
            import os

            os._exit(3)


def same_state(a: object, b: object) -> bool:
    """Two state dicts (tensors, and the nested dicts of extra state) hold exactly the same values."""
    import torch

    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) == set(b) == {"packed"}:  # a balancer's state packed as bytes: compared by what it holds
            from multiloss.balancers.protocol import unpack_state

            return same_state(unpack_state(a), unpack_state(b))
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):  # every rank's state, an optimizer's groups
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


def padded_token_npz(
    path: Path, n: int = 16, seq_len: int = 24, vocab: int = 11, longest: int = 24, seed: int = 0
) -> Path:
    """A user's variable-length token data as ``data=npz`` takes it: ``x``/``y`` padded with id 0 to
    ``seq_len``, and ``mask`` (bool, 1 on the ``lengths`` real targets), lengths 1..``longest``."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, size=(n, seq_len + 1))
    lengths = rng.integers(1, longest + 1, size=n)
    mask = np.arange(seq_len)[None, :] < lengths[:, None]
    x, y = np.where(mask, tokens[:, :-1], 0), np.where(mask, tokens[:, 1:], 0)
    np.savez(path, x=x, y=y, mask=mask)
    return path


def padded_tbptt(path: Path, vocab: int = 11) -> tuple[str, ...]:
    """The overrides that train tbptt on `padded_token_npz` data at ``path``."""
    return (
        "recipe=tbptt",
        "data=npz",
        f"data.path={path}",
        "data.val_fraction=0",
        f"model.vocab={vocab}",
        "model.sample_prompt='1 2'",
        "model.sample_length=5",
    )


class SignalAt(L.Callback):
    """Sends ``signum`` (SIGTERM) to this very process, as a scheduler would, as the batch of ``step`` starts.

    On ``rank`` only (every rank when None); once per process (``times`` signals in a row). The signal is
    real: the run's own handler receives it between two bytecodes, wherever the step is.
    """

    def __init__(self, step: int = 5, rank: int | None = None, signum: int = 15, times: int = 1) -> None:
        self.step, self.rank, self.signum, self.times, self.sent = step, rank, signum, times, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.sent or trainer.global_step < self.step or self.rank not in (None, trainer.global_rank):
            return
        import os

        self.sent = True
        for _ in range(self.times):  # twice: a person pressing Ctrl-C again
            os.kill(os.getpid(), self.signum)


class DieOnce(L.Callback):
    """``DieOnRank`` on the first attempt of a torchrun-restarted job only (TORCHELASTIC_RESTART_COUNT 0)."""

    def __init__(self, rank: int = 1, step: int = 2) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import os

        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and trainer.global_rank == self.rank and trainer.global_step >= self.step:
            os._exit(3)


def char_streams(train_file: Path, val_file: Path) -> tuple[str, ...]:
    """tbptt over character streams of two text files, plain SGD at 0.5, no clipping: the overrides the
    stream proofs share (each adds its sizes and its net)."""
    return (
        "recipe=tbptt",
        "data=text",
        f"data.path={train_file}",
        f"data.val_path={val_file}",
        "data.level=chars",
        "data.layout=streams",
        "model.gradient_clip_val=null",
        "optimizer=sgd",
        "model.optimizer.lr=0.5",
        "model.sample_length=5",
    )


def logged_rows(run: Path) -> list[dict[str, str]]:
    """The rows of a run dir's newest ``metrics.csv`` (a run resumed in its own dir writes ``version_<n+1>``, which
    starts with the rows of the run it continues)."""
    import csv

    files = sorted((run / "csv").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    with files[-1].open(newline="") as f:
        return list(csv.DictReader(f))


def logged_rates(run: Path) -> dict[int, tuple[float, ...]]:
    """Each optimizer step's learning rates (every ``lr*`` column), from the newest ``metrics.csv``.

    One entry a step: under accumulation Lightning's LR monitor logs at each micro-batch of a step.
    """
    rows = logged_rows(run)
    columns = sorted(c for c in rows[0] if c.startswith("lr"))
    return {
        int(row["step"]): tuple(float(row[c]) for c in columns if row[c])
        for row in rows
        if any(row[c] for c in columns)
    }


class CollectiveOnOneRank(L.Callback):
    """At the end of training epoch ``epoch`` (the second), ``rank`` alone waits in a barrier the other ranks never
    issue (they go on to the next collective of the run): the shape of a rank-zero-only reader that reduces a metric."""

    def __init__(self, rank: int = 0, epoch: int = 1) -> None:
        self.rank, self.epoch = rank, epoch

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == self.rank and trainer.current_epoch == self.epoch:
            dist.barrier()


class SyncedEpochValue(L.Callback):
    """Logs ``probe`` = 1 on every rank at each training batch's end as an epoch value reduced over the ranks
    (``sync_dist=True``): Lightning reduces it lazily, at the first read after the epoch's last batch."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.log("probe", 1.0, on_step=False, on_epoch=True, sync_dist=True, prog_bar=True)


class GroupStateAtExit(L.Callback):
    """Writes, at this process's exit (after everything else), whether its process group was still up:
    ``group_at_exit_rank<r>.txt`` in ``dirpath``."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath

    def on_train_start(self, trainer, pl_module) -> None:
        import atexit

        path = Path(self.dirpath) / f"group_at_exit_rank{trainer.global_rank}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        atexit.register(lambda: path.write_text(str(dist.is_initialized())))


class SignalInValidation(L.Callback):
    """Sends SIGTERM to this process as the first validation batch after optimizer step ``step`` starts (once): a
    scheduler's stop that lands inside a mid-epoch validation."""

    def __init__(self, step: int) -> None:
        self.step, self.sent = step, False

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if not self.sent and not trainer.sanity_checking and trainer.global_step >= self.step:
            import os
            import signal

            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


class SlowSetup(L.Callback):
    """Sleeps ``seconds`` in Lightning's ``setup`` (having touched ``marker``): a run held in its set-up, the run
    dir's lock already taken."""

    def __init__(self, seconds: float = 60, marker: str | None = None) -> None:
        self.seconds, self.marker = seconds, marker

    def setup(self, trainer, pl_module, stage) -> None:
        import time
        from pathlib import Path

        if self.marker:  # a file that says the run is in its set-up now
            Path(self.marker).touch()
        time.sleep(self.seconds)
