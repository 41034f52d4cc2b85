"""multiloss against the hand-written loop it replaces: time per batch, peak memory, same weights after.

    python benchmarks/speed.py                           # CPU, 1 thread, every recipe, fp32
    python benchmarks/speed.py --device cuda --precision bf16-mixed
    python benchmarks/speed.py --recipes gan tbptt --rounds 7 --batches 300
    python benchmarks/speed.py --compile                 # model.compile=true against the eager loop

Per recipe, one process runs, interleaved over ``--rounds`` rounds:

- **plain**: the hand-written loop in plain PyTorch (a `PlainStep` per recipe, below) on the same network
  object, initial weights, data loader (so the same order) and optimizer the recipe builds;
- **lightning**: the same plain step, verbatim, as the manual step of a bare LightningModule under a
  bare Trainer: what Lightning's own loop costs, the floor under every recipe;
- **off**: ``multiloss.train(cfg)`` with ``logger=none callbacks=none``, no progress bar, model
  summary or checkpointing (what multiloss always adds stays: RNG states, run record, non-finite
  guard, leak check);
- **defaults**: ``multiloss.train(cfg)`` with the shipped logger and callbacks;
- **compiled** (``--modes ... compiled``): *off* with ``model.compile=true`` (``--compile`` instead
  compiles every kind, the plain nets too).

Validation is off in all (``trainer.limit_val_batches=0``): this measures training. Each run notes
the time at the end of every batch (a batch is one ``training_step``: a micro-batch under
accumulation, a whole sequence of chunks in tbptt) from batch ``--warmup`` on, for ``--batches``
batches. "ms" is the median batch of a run (robust to a noisy machine), "all batches" the mean,
log rows and epoch ends (loader restarts, epoch-end hooks) included; both are medians over the
rounds, and ratios are to the plain loop's. Peak memory is ``torch.cuda.max_memory_allocated`` on
CUDA, the largest resident set size seen at a batch end on CPU. ``max abs Δw`` compares every
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hydra.utils import get_method, instantiate  # noqa: E402

from multiloss.batches import as_dict  # noqa: E402
from multiloss.builders import build_data_and_model  # noqa: E402
from multiloss.testing import bare_trainer, compose  # noqa: E402
from multiloss.training import train  # noqa: E402

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


# --- the plain steps: the hand-written loop, one per recipe -------------------------------------------


class PlainStep:
    """One recipe's training step in plain PyTorch: its optimizers are built here, from the recipe's config."""

    def __init__(self, nets: dict[str, torch.nn.Module], cfg: Any, device: torch.device, autocast: Any) -> None:
        self.nets, self.cfg, self.device, self.autocast = nets, cfg, device, autocast

    def __call__(self, epoch: int, i: int, last: bool, batch: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError


class MultiheadStep(PlainStep):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.opt = instantiate(self.cfg.model.optimizer)(self.nets["net"].parameters())

    def __call__(self, epoch, i, last, batch):
        with self.autocast():
            loss = sum(F.cross_entropy(logits, batch["y"]) for logits in self.nets["net"](batch["x"]))
        self.opt.zero_grad()
        loss.backward()  # one backward of the summed heads
        self.opt.step()


class WeightedStep(PlainStep):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.tasks = self.cfg.model.tasks
        self.loss_fns = {name: get_method(t.loss) for name, t in self.tasks.items()}
        self.weights = torch.tensor([float(t.weight) for t in self.tasks.values()], device=self.device)
        self.opt = instantiate(self.cfg.model.optimizer)(self.nets["net"].parameters())

    def __call__(self, epoch, i, last, batch):
        with self.autocast():
            outputs = self.nets["net"](batch["x"])
            losses = torch.stack([self.loss_fns[n](outputs[n], batch[t.target]) for n, t in self.tasks.items()])
        self.opt.zero_grad()
        torch.autograd.backward(losses, grad_tensors=self.weights.to(losses.dtype))  # one grad_tensors backward
        self.opt.step()


class GanStep(PlainStep):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        m = self.m = self.cfg.model
        self.opt_g = instantiate(m.g_optimizer)(self.nets["generator"].parameters())
        self.opt_d = instantiate(m.d_optimizer)(self.nets["discriminator"].parameters())
        decay = functools.partial(lambda e, n: max(0.0, 1 - e / n), n=self.cfg.trainer.max_epochs)
        self.schedules = [torch.optim.lr_scheduler.LambdaLR(o, decay) for o in (self.opt_g, self.opt_d)]
        self.noise = torch.Generator(device=self.device).manual_seed(m.noise_seed)
        self.epoch = 0

    def draw(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.randn(n, self.m.latent_dim + 1, generator=self.noise, device=self.device)
        return rows[:, :-1], torch.special.ndtr(rows[:, -1:])

    def __call__(self, epoch, i, last, batch):
        G, D, m = self.nets["generator"], self.nets["discriminator"], self.m
        while self.epoch < epoch:  # the learning rates fall per epoch
            for s in self.schedules:
                s.step()
            self.epoch += 1
        real = batch["x"]
        with self.autocast():
            z, eps = self.draw(len(real))
            fake = G(z).detach()
            loss_d = -D(real).mean() + D(fake).mean()
            x_hat = (eps * real + (1 - eps) * fake).requires_grad_(True)
            (grad,) = torch.autograd.grad(D(x_hat).sum(), x_hat, create_graph=True)
            loss_d = loss_d + m.gp_weight * ((grad.flatten(1).norm(2, dim=1) - 1) ** 2).mean()
        self.opt_d.zero_grad()
        loss_d.backward()
        self.opt_d.step()
        if (i + 1) % m.n_critic == 0:
            with self.autocast():
                z, _ = self.draw(len(real))
                loss_g = -D(G(z)).mean()
            self.opt_g.zero_grad()
            loss_g.backward()
            self.opt_g.step()


class TbpttStep(PlainStep):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.opt = instantiate(self.cfg.model.optimizer)(self.nets["net"].parameters())

    def __call__(self, epoch, i, last, batch):
        net, m = self.nets["net"], self.cfg.model
        hidden = None
        for x, y in zip(batch["x"].split(m.chunk_length, 1), batch["y"].split(m.chunk_length, 1)):
            with self.autocast():
                logits, hidden = net(x, hidden)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            self.opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), m.gradient_clip_val)
            self.opt.step()
            hidden = tuple(h.detach() for h in hidden)  # repackage_hidden


class AccumulationStep(PlainStep):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.k = self.cfg.model.accumulate_grad_batches
        self.opt = instantiate(self.cfg.model.optimizer)(self.nets["net"].parameters())
        for group in self.opt.param_groups:  # the linear rule: lr × (batch × k) / base batch
            group["lr"] *= self.cfg.data.batch_size * self.k / self.cfg.model.base_batch_size

    def __call__(self, epoch, i, last, batch):
        with self.autocast():
            loss = F.cross_entropy(self.nets["net"](batch["x"]), batch["y"]) / self.k  # loss / k
        loss.backward()
        if (i + 1) % self.k == 0 or last:
            self.opt.step()
            self.opt.zero_grad()


STEPS: dict[str, type[PlainStep]] = {
    "multihead": MultiheadStep,
    "weighted": WeightedStep,
    "gan": GanStep,
    "tbptt": TbpttStep,
    "accumulation": AccumulationStep,
}
NETS = {"gan": ("generator", "discriminator")}


def batches(loader: Any, device: torch.device) -> Iterator[tuple[int, int, bool, dict[str, torch.Tensor]]]:
    """(epoch, index, last of the epoch, batch on device), forever; the sampler reshuffles per epoch."""
    for epoch in itertools.count():
        loader.sampler.set_epoch(epoch)
        n = len(loader)
        for i, batch in enumerate(loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in as_dict(batch).items()}
            yield epoch, i, i + 1 == n, batch


class BareLightning(L.LightningModule):
    """The plain step, verbatim, as a LightningModule's manual step: Lightning's own loop and nothing else.

    Its optimizers are the step's raw torch optimizers (Lightning never sees them): what is left is
    what any LightningModule pays per batch, the floor under every recipe.
    """

    def __init__(self, step: PlainStep, window: Window) -> None:
        super().__init__()
        self.step, self.window = step, window
        self.nets = torch.nn.ModuleDict(step.nets)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        last = batch_idx + 1 == self.trainer.num_training_batches
        self.step(self.current_epoch, batch_idx, last, as_dict(batch))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.window.batch_ended():
            self.trainer.should_stop = True

    def configure_optimizers(self) -> None:
        return None


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
    if args.compile or mode == "compiled":
        common.append("model.compile=true")
    if mode in ("off", "compiled"):
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


def run_plain(args: argparse.Namespace, recipe: str, out: Path, lightning: bool = False) -> tuple[Window, dict]:
    """The plain step in a plain loop, or (``lightning``) in a bare LightningModule under a bare Trainer."""
    cfg = compose(*overrides(args, recipe, "off"), output_dir=out)
    device = torch.device(args.device)
    datamodule, module = build_data_and_model(cfg)  # the same seed, so the same initial weights
    module.to(device)
    nets = {name: getattr(module, name) for name in NETS.get(recipe, ("net",))}
    if args.compile:
        for net in nets.values():
            net.compile()
    window = Window(args.warmup, args.batches or BATCHES[recipe], device)
    if args.precision == "bf16-mixed":
        # As Lightning's bf16-mixed: no cast cache. With it, a weight used several times in a step (the
        # critic on real, fake and interpolated samples) sums its gradient in bf16 first: not the same numbers.
        autocast = functools.partial(torch.autocast, device_type=args.device, dtype=torch.bfloat16, cache_enabled=False)
    else:
        autocast = contextlib.nullcontext
    step = STEPS[recipe](nets, cfg, device, autocast)
    if lightning:
        bare = BareLightning(step, window)
        trainer = bare_trainer(
            accelerator="gpu" if args.device == "cuda" else "cpu", max_epochs=-1, callbacks=[_WindowStart(window)]
        )
        trainer.fit(bare, datamodule=datamodule)
    else:
        datamodule.setup("fit")
        window.begin()
        for epoch, i, last, batch in batches(datamodule.train_dataloader(), device):
            step(epoch, i, last, batch)
            if window.batch_ended():
                break
    return window, {k: v.detach().clone() for k, v in module.state_dict().items()}


class _WindowStart(L.Callback):
    def __init__(self, window: Window) -> None:
        self.window = window

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.window.begin()


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    common = [k for k in a if k in b and a[k].is_floating_point()]
    if not common:
        return math.nan
    return max((a[k].float().cpu() - b[k].float().cpu()).abs().max().item() for k in common)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed"))
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=10, help="batches before the timed window")
    parser.add_argument("--batches", type=int, default=0, help="timed batches per run (default: per recipe)")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["lightning", "off", "defaults"],
        choices=("lightning", "off", "defaults", "compiled"),
        help="compiled: off with model.compile=true, against the eager plain loop",
    )
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
                    if kind in ("plain", "lightning"):
                        window, weights = run_plain(args, recipe, out, lightning=kind == "lightning")
                    else:
                        window, weights = run_recipe(args, recipe, kind, out)
                    results[kind].ms.append(window.median_ms)
                    results[kind].mean_ms.append(window.mean_ms)
                    results[kind].peak.append(window.peak)
                    results[kind].weights = weights
            print(row(recipe, results, args.modes), flush=True)


def row(recipe: str, results: dict[str, Result], modes: list[str]) -> str:
    """ms per batch (ratio to plain) per kind, the all-batches ratios, peak memory, the weights' difference."""
    plain = statistics.median(results["plain"].ms)
    plain_all = statistics.median(results["plain"].mean_ms)
    cells = [recipe, f"{plain:.2f}"]
    for kind in modes:
        ms = statistics.median(results[kind].ms)
        cells.append(f"{ms:.2f} (**{ms / plain:.2f}×**)")
    cells.append(" / ".join(f"{statistics.median(results[k].mean_ms) / plain_all:.2f}×" for k in modes))
    cells.append(" / ".join(f"{max(results[k].peak) / 2**20:.0f}" for k in results))
    cells.append(" / ".join(f"{largest_difference(results[k].weights, results['plain'].weights):.0e}" for k in modes))
    return "| " + " | ".join(cells) + " |"


def header(modes: list[str]) -> str:
    kinds = " / ".join(modes)
    names = [
        "recipe",
        "plain ms/batch",
        *(f"{LABELS[k]} ms (ratio)" for k in modes),
        f"ratio, all batches ({kinds})",
        f"peak MiB (plain / {kinds})",
        f"max abs Δw ({kinds})",
    ]
    return "| " + " | ".join(names) + " |\n|---|" + "---:|" * (len(names) - 1)


LABELS = {
    "lightning": "bare Lightning",
    "off": "multiloss, off",
    "defaults": "multiloss, defaults",
    "compiled": "multiloss, off, compiled",
}


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
