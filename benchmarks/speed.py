"""multiloss against the hand-written loop it replaces: time per optimizer step, CPU and wall, same weights after.

    python benchmarks/speed.py                           # CPU, 1 thread, every recipe, fp32
    python benchmarks/speed.py --device cuda --precision bf16-mixed
    python benchmarks/speed.py --recipes gan tbptt --rounds 7
    python benchmarks/speed.py --size realistic          # wider networks (the per-step cost is then compute)
    python benchmarks/speed.py --modes off compiled      # model.compile=true against the eager loop
    python benchmarks/speed.py --count                   # calls and ATen operators per step: no clock at all

Per recipe, one process runs, interleaved over ``--rounds`` rounds, in an order that rotates from
round to round (so no kind always runs first, or right after the same other kind):

- **plain**: the hand-written loop in plain PyTorch (a `PlainStep` per recipe, below) on the same
  network object, initial weights, data loader (so the same order) and optimizer the recipe builds;
- **lightning**: the same plain step, verbatim, as the training step of a bare manual-optimization
  LightningModule whose optimizers Lightning never sees (raw ``loss.backward()``, ``opt.step()``):
  Lightning's batch loop and hooks alone;
- **manual**: the same plain step written with Lightning's manual-optimization API — its optimizers
  returned by ``configure_optimizers``, ``self.manual_backward(loss)``, ``opt.step()`` and
  ``opt.zero_grad()`` on Lightning's optimizer wrappers: what any manual LightningModule pays, the
  floor under every recipe (each recipe runs under manual optimization);
- **off**: ``multiloss.train(cfg)`` with ``logger=none callbacks=none``, no progress bar, model
  summary or checkpointing (what multiloss always adds stays: RNG states, run record, non-finite
  guard, leak check, the training log);
- **defaults**: ``multiloss.train(cfg)`` with the shipped logger and callbacks;
- **compiled** (``--modes ... compiled``): *off* with ``model.compile=true``.

Validation is off in all (``trainer.limit_val_batches=0``): this measures training. Each run is timed
over a window of ``--batches`` training batches after ``--warmup`` (a batch is one ``training_step``:
a micro-batch under accumulation, a whole sequence of chunks in tbptt), log rows and epoch ends
included, and the window's time is divided by the optimizer steps taken in it (a GAN batch makes
1 + 1/n_critic of them, a tbptt batch one per chunk, an accumulation micro-batch 1/k): **ms per
optimizer step**, as CPU time of the process (``time.process_time``: what the step cost, whatever
else the machine did) and wall time. Cells are medians over the rounds; ratios are to the plain loop,
and for multiloss also to the manual floor. ``max abs Δw`` compares every weight after the window
with the plain loop's: 0 means the same arithmetic, bit for bit.

``--count`` runs each kind once and counts, over the same window, the Python and C function calls
(``cProfile``) and the ATen operators dispatched, forward and backward (a ``TorchDispatchMode``),
per optimizer step: what a step costs the interpreter and the kernel launcher, without the clock's
noise (a small model's step is mostly these; on a shared 2-core machine the timings move ±20 %).

A benchmark, not a test: timings move with the machine's load; read the ratios, rerun to compare.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import itertools
import math
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The checkout's root (the tests' plain references); multiloss itself as installed (`make train`): its
# `multiloss.configs` exists only installed, and `src` first would shadow a wheel installed without `-e`.
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hydra.utils import get_method, instantiate  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from multiloss.data.batches import as_dict  # noqa: E402
from multiloss.testing import bare_trainer, compose  # noqa: E402
from multiloss.training import build_data_and_model, train  # noqa: E402

RECIPES = ("multihead", "weighted", "gan", "tbptt", "accumulation")
# Batches timed per run (after the warm-up): a few epochs of digits, a fraction of the GAN's and tbptt's.
BATCHES = {"multihead": 200, "weighted": 200, "gan": 200, "tbptt": 40, "accumulation": 400}
# --size realistic: networks whose step is compute, not launches and Python.
REALISTIC = {
    "multihead": ("model.net.width=1024",),
    "weighted": ("model.net.width=1024",),
    "gan": ("model.generator.width=512", "model.discriminator.width=512"),
    "tbptt": ("model.net.hidden_size=512",),
    "accumulation": ("model.net.width=1024",),
}
KINDS = ("plain", "lightning", "manual", "off", "defaults", "compiled")
LABELS = {
    "lightning": "bare Lightning, raw optimizers",
    "manual": "bare Lightning manual (floor)",
    "off": "multiloss, off",
    "defaults": "multiloss, defaults",
    "compiled": "multiloss, off, compiled",
}


@dataclass
class Window:
    """The timed stretch of one run: the batches ending after batch ``warmup``, ``batches`` of them."""

    warmup: int
    batches: int
    device: torch.device
    seen: int = 0
    start: tuple[float, float] = (0.0, 0.0)  # (wall, cpu) at the window's start
    end: tuple[float, float] = (0.0, 0.0)
    steps_at_start: int = 0
    steps: int = 0  # optimizer steps taken inside the window
    done: bool = False
    counter: Counter | None = None  # --count: counts calls and operators inside the window

    def batch_ended(self, steps_so_far: int) -> bool:
        """Count a batch (``steps_so_far``: optimizer steps since the run began); True when the window is complete."""
        self.seen += 1
        if self.seen == self.warmup:
            self._sync()
            self.start, self.steps_at_start = (time.perf_counter(), time.process_time()), steps_so_far
            if self.counter is not None:
                self.counter.start()
        if self.seen == self.warmup + self.batches:
            if self.counter is not None:
                self.counter.stop()
            self._sync()
            self.end = (time.perf_counter(), time.process_time())
            self.steps = steps_so_far - self.steps_at_start
            self.done = True
        return self.done

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def wall_ms(self) -> float:
        return 1e3 * (self.end[0] - self.start[0]) / max(self.steps, 1)

    @property
    def cpu_ms(self) -> float:
        return 1e3 * (self.end[1] - self.start[1]) / max(self.steps, 1)


class Counter(TorchDispatchMode):
    """Between `start` and `stop`: function calls (``what="calls"``, cProfile) or ATen operators dispatched,
    forward and backward (``what="ops"``, this mode). One at a time: the mode's own Python would count as calls."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what, self.count = what, 0
        self.profile = cProfile.Profile()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))

    def start(self) -> None:
        if self.what == "ops":
            self.__enter__()
        else:
            self.profile.enable()

    def stop(self) -> None:
        if self.what == "ops":
            self.__exit__(None, None, None)
        else:
            self.profile.disable()
            self.count = pstats.Stats(self.profile).total_calls


class StepTimer(L.Callback):
    """Times the recipe's batches (`Window`), stops the run after the window and keeps the final weights."""

    # train() builds the timer from the config (+callbacks.bench_timer): the window goes in, the timer out, here.
    window: Window | None = None
    current: StepTimer | None = None

    def __init__(self) -> None:
        self.window = StepTimer.window
        self.weights: dict[str, torch.Tensor] = {}
        StepTimer.current = self

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.window.batch_ended(trainer.global_step) and not self.weights:
            self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            trainer.should_stop = True


# --- the plain steps: the hand-written loop, one per recipe ---------------------------------------------


class TorchCalls:
    """The plain loop's backward, step and zeroing: torch's own calls."""

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        loss.backward(**kwargs)

    def step(self, opt: torch.optim.Optimizer) -> None:
        opt.step()

    def zero_grad(self, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()


class LightningCalls(TorchCalls):
    """The same calls through Lightning's manual-optimization API: ``manual_backward`` and its optimizer wrappers."""

    def __init__(self, module: L.LightningModule) -> None:
        self.module = module

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.module.manual_backward(loss, **kwargs)

    def step(self, opt: torch.optim.Optimizer) -> None:
        self._wrapper(opt).step()

    def zero_grad(self, opt: torch.optim.Optimizer) -> None:
        self._wrapper(opt).zero_grad()

    def _wrapper(self, opt: torch.optim.Optimizer) -> Any:
        optimizers = self.module.optimizers()
        for wrapped in optimizers if isinstance(optimizers, list) else [optimizers]:
            if wrapped.optimizer is opt:
                return wrapped
        raise LookupError(opt)


class PlainStep:
    """One recipe's training step in plain PyTorch: its optimizers are built here, from the recipe's config.

    ``calls`` does the backward, the step and the zeroing (torch's, or Lightning's manual API);
    ``steps`` counts the optimizer steps taken.
    """

    def __init__(self, nets: dict[str, torch.nn.Module], cfg: Any, device: torch.device, autocast: Any) -> None:
        self.nets, self.cfg, self.device, self.autocast = nets, cfg, device, autocast
        self.calls: TorchCalls = TorchCalls()
        self.steps = 0

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.opt]

    def stepped(self, opt: torch.optim.Optimizer) -> None:
        self.calls.step(opt)
        self.steps += 1

    def __call__(self, epoch: int, i: int, last: bool, batch: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError


class MultiheadStep(PlainStep):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.opt = instantiate(self.cfg.model.optimizer)(self.nets["net"].parameters())

    def __call__(self, epoch, i, last, batch):
        with self.autocast():
            loss = sum(F.cross_entropy(logits, batch["y"]) for logits in self.nets["net"](batch["x"]))
        self.calls.zero_grad(self.opt)
        self.calls.backward(loss)  # one backward of the summed heads
        self.stepped(self.opt)


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
        self.calls.zero_grad(self.opt)
        self.calls.backward(losses, gradient=self.weights.to(losses.dtype))  # one grad_tensors backward
        self.stepped(self.opt)


class GanStep(PlainStep):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        m = self.m = self.cfg.model
        self.opt_g = instantiate(m.g_optimizer)(self.nets["generator"].parameters())
        self.opt_d = instantiate(m.d_optimizer)(self.nets["discriminator"].parameters())
        decay = functools.partial(lambda e, n: max(0.0, 1 - e / n), n=self.cfg.trainer.max_epochs)
        self.schedules = [torch.optim.lr_scheduler.LambdaLR(o, decay) for o in (self.opt_g, self.opt_d)]
        self.noise = torch.Generator(device=self.device).manual_seed(m.noise_seed)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.opt_g, self.opt_d]

    def draw(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.randn(n, self.m.latent_dim + 1, generator=self.noise, device=self.device)
        return rows[:, :-1], torch.special.ndtr(rows[:, -1:])

    def __call__(self, epoch, i, last, batch):
        G, D, m = self.nets["generator"], self.nets["discriminator"], self.m
        real = batch["x"]
        with self.autocast():
            z, eps = self.draw(len(real))
            fake = G(z).detach()
            loss_d = -D(real).mean() + D(fake).mean()
            x_hat = (eps * real + (1 - eps) * fake).requires_grad_(True)
            (grad,) = torch.autograd.grad(D(x_hat).sum(), x_hat, create_graph=True)
            loss_d = loss_d + m.penalties["gp"] * ((grad.flatten(1).norm(2, dim=1) - 1) ** 2).mean()
        self.calls.zero_grad(self.opt_d)
        self.calls.backward(loss_d)
        self.stepped(self.opt_d)
        if (i + 1) % m.n_critic == 0:
            with self.autocast():
                z, _ = self.draw(len(real))
                loss_g = -D(G(z)).mean()
            self.calls.zero_grad(self.opt_g)
            self.calls.backward(loss_g)
            self.stepped(self.opt_g)
        if last:  # the learning rates fall per epoch
            for s in self.schedules:
                s.step()


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
            self.calls.zero_grad(self.opt)
            self.calls.backward(loss)
            torch.nn.utils.clip_grad_norm_(net.parameters(), m.gradient_clip_val)
            self.stepped(self.opt)
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
        self.calls.backward(loss)
        if (i + 1) % self.k == 0 or last:
            self.stepped(self.opt)
            self.calls.zero_grad(self.opt)


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
    """The plain step, verbatim, as a manual-optimization LightningModule's training step.

    ``manual=False``: its optimizers are the step's raw torch optimizers (Lightning never sees them).
    ``manual=True``: Lightning's manual-optimization API (`LightningCalls`): the floor under every recipe.
    """

    def __init__(self, step: PlainStep, window: Window, manual: bool) -> None:
        super().__init__()
        self.step, self.window, self.manual = step, window, manual
        self.nets = torch.nn.ModuleDict(step.nets)
        self.automatic_optimization = False
        if manual:
            step.calls = LightningCalls(self)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        last = batch_idx + 1 == self.trainer.num_training_batches
        self.step(self.current_epoch, batch_idx, last, as_dict(batch))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.window.batch_ended(self.step.steps):
            self.trainer.should_stop = True

    def configure_optimizers(self) -> Any:
        return self.step.optimizers() if self.manual else None


# --- one run of each kind ------------------------------------------------------------------------


@dataclass
class Result:
    cpu_ms: list[float] = field(default_factory=list)  # per run: CPU ms per optimizer step
    wall_ms: list[float] = field(default_factory=list)
    calls: float = 0.0  # --count: function calls per optimizer step
    ops: float = 0.0  # --count: ATen operators per optimizer step
    weights: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def cpu(self) -> float:
        return statistics.median(self.cpu_ms)

    @property
    def wall(self) -> float:
        return statistics.median(self.wall_ms)


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
        *(REALISTIC[recipe] if args.size == "realistic" else ()),
        *args.override,
    ]
    if mode == "compiled":
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
    window = StepTimer.window = Window(args.warmup, batches_of(args, recipe), torch.device(args.device))
    window.counter = Counter(args.count) if args.count else None
    # The progress bar draws as usual, into /dev/null: the table is this script's output.
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        train(cfg)
    return window, StepTimer.current.weights


def run_plain(args: argparse.Namespace, recipe: str, kind: str, out: Path) -> tuple[Window, dict]:
    """The plain step in a plain loop, or in a bare LightningModule (raw optimizers, or Lightning's manual API)."""
    cfg = compose(*overrides(args, recipe, "off"), output_dir=out)
    device = torch.device(args.device)
    datamodule, module = build_data_and_model(cfg)  # the same seed, so the same initial weights
    module.to(device)
    nets = {name: getattr(module, name) for name in NETS.get(recipe, ("net",))}
    window = Window(args.warmup, batches_of(args, recipe), device)
    window.counter = Counter(args.count) if args.count else None
    if args.precision == "bf16-mixed":
        # As Lightning's bf16-mixed: no cast cache. With it, a weight used several times in a step (the
        # critic on real, fake and interpolated samples) sums its gradient in bf16 first: not the same numbers.
        autocast = functools.partial(torch.autocast, device_type=args.device, dtype=torch.bfloat16, cache_enabled=False)
    else:
        autocast = contextlib.nullcontext
    step = STEPS[recipe](nets, cfg, device, autocast)
    if kind in ("lightning", "manual"):
        bare = BareLightning(step, window, manual=kind == "manual")
        accelerator = "gpu" if args.device == "cuda" else "cpu"
        bare_trainer(accelerator=accelerator, max_epochs=-1, max_steps=-1).fit(bare, datamodule=datamodule)
    else:
        datamodule.setup("fit")
        for epoch, i, last, batch in batches(datamodule.train_dataloader(), device):
            step(epoch, i, last, batch)
            if window.batch_ended(step.steps):
                break
    return window, {k: v.detach().clone() for k, v in module.state_dict().items()}


def batches_of(args: argparse.Namespace, recipe: str) -> int:
    return args.batches or BATCHES[recipe]


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
    parser.add_argument("--size", default="default", choices=("default", "realistic"))
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["lightning", "manual", "off", "defaults"],
        choices=KINDS[1:],
        help="compiled: off with model.compile=true, against the eager plain loop",
    )
    parser.add_argument("--override", nargs="*", default=[], help="extra config overrides for every run")
    parser.add_argument("--count", action="store_true", help="count calls and ATen operators per step (no clock)")
    args = parser.parse_args()
    if args.count:
        args.rounds, args.count = 2, "calls"  # round 0 counts calls, round 1 operators
    torch.set_num_threads(args.threads)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    print(machine(args))
    print()
    print(count_header(args.modes) if args.count else header(args.modes))
    kinds = ("plain", *args.modes)
    with tempfile.TemporaryDirectory(prefix="multiloss-bench-") as tmp:
        for recipe in args.recipes:
            results = {kind: Result() for kind in kinds}
            for r in range(args.rounds):
                for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:  # a rotating order
                    out = Path(tmp) / f"{recipe}-{kind}-{r}"
                    if kind in ("plain", "lightning", "manual"):
                        window, weights = run_plain(args, recipe, kind, out)
                    else:
                        window, weights = run_recipe(args, recipe, kind, out)
                    results[kind].cpu_ms.append(window.cpu_ms)
                    results[kind].wall_ms.append(window.wall_ms)
                    results[kind].weights = weights
                    if window.counter is not None:
                        setattr(results[kind], window.counter.what, window.counter.count / window.steps)
                if args.count:
                    args.count = "ops" if args.count == "calls" else "calls"
            print((count_row if args.count else row)(recipe, args, results), flush=True)


def row(recipe: str, args: argparse.Namespace, results: dict[str, Result]) -> str:
    """CPU ms per optimizer step (ratio to plain; multiloss's also to the manual floor), wall ratios, Δw."""
    plain = results["plain"]
    floor = results.get("manual")
    cells = [recipe + (" (realistic)" if args.size == "realistic" else ""), f"{plain.cpu:.3f}"]
    for kind in args.modes:
        ratio = f"{results[kind].cpu:.3f} (**{results[kind].cpu / plain.cpu:.2f}×**"
        if floor is not None and kind in ("off", "defaults", "compiled"):
            ratio += f", {results[kind].cpu / floor.cpu:.2f}× floor"
        cells.append(ratio + ")")
    cells.append(f"{plain.wall:.3f}")
    cells.append(" / ".join(f"{results[k].wall / plain.wall:.2f}×" for k in args.modes))
    cells.append(" / ".join(f"{largest_difference(results[k].weights, plain.weights):.0e}" for k in args.modes))
    return "| " + " | ".join(cells) + " |"


def count_row(recipe: str, args: argparse.Namespace, results: dict[str, Result]) -> str:
    """Calls and ATen operators per optimizer step of each kind, and multiloss's over the manual floor."""
    cells = [recipe + (" (realistic)" if args.size == "realistic" else "")]
    floor = results.get("manual")
    for kind in ("plain", *args.modes):
        cell = f"{results[kind].calls:,.0f} / {results[kind].ops:,.0f}"
        if floor is not None and kind in ("off", "defaults", "compiled"):
            cell += f" (+{results[kind].calls - floor.calls:,.0f} / +{results[kind].ops - floor.ops:,.0f})"
        cells.append(cell)
    return "| " + " | ".join(cells) + " |"


def count_header(modes: list[str]) -> str:
    names = ["recipe", "plain", *(LABELS[k] for k in modes)]
    return (
        "calls / ATen operators per optimizer step (multiloss: + over the manual floor)\n\n| "
        + " | ".join(names)
        + " |\n|---|"
        + "---:|" * (len(names) - 1)
    )


def header(modes: list[str]) -> str:
    kinds = " / ".join(modes)
    names = [
        "recipe",
        "plain CPU ms/step",
        *(f"{LABELS[k]} CPU ms (ratio)" for k in modes),
        "plain wall ms/step",
        f"wall ratio ({kinds})",
        f"max abs Δw ({kinds})",
    ]
    return "| " + " | ".join(names) + " |\n|---|" + "---:|" * (len(names) - 1)


def machine(args: argparse.Namespace) -> str:
    if args.device == "cuda":
        where = torch.cuda.get_device_name()
    else:
        where = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} torch thread(s)"
    return (
        f"Machine: {where}; torch {torch.__version__}, lightning {L.__version__}, Python "
        f"{platform.python_version()}; precision {args.precision}; size {args.size}; {args.rounds} rounds "
        f"(rotating order), median; {args.warmup} warm-up batches; per optimizer step."
    )


if __name__ == "__main__":
    main()
