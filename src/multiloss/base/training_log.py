"""Training values between two log rows: kept on their device step by step, written as means on Lightning's rows.

Logging a value with ``self.log`` costs about 2,000 Python calls, more than a small model's whole
step; reading it on the host every step would sync a GPU every step. Here a recipe adds each step's
values (one vector per group of names, `TrainingLog.add`) to a buffer on their device — one kernel a
step — and `TrainingLogWriter`, a callback the recipe returns, writes their means as one row to every
logger on the rows Lightning writes (every ``trainer.log_every_n_steps`` steps, and when training
ends): one host read a row, none in between. The rows also say which step first held a NaN or inf:
the non-finite guard reads that here instead of watching each step itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import torch

from multiloss import lightning_internals as internals
from multiloss.callbacks.lean import LeanCallback


class StepRows:
    """One row of values per step (with that step's number), on their device, until they are read.

    The buffer doubles when full; past ``limit`` rows (a run that never writes a row) they are folded
    into a running sum with one host read, so memory stays bounded.
    """

    limit = 1024

    def __init__(
        self, width: int, device: torch.device, scalars: bool = False, dtype: torch.dtype = torch.float32
    ) -> None:
        self.rows = torch.empty(8, width, device=device, dtype=dtype)
        self.scalars = scalars  # values come as 0-d float32 tensors: stacked as they are
        self.steps: list[int] = []
        self.folded: tuple[torch.Tensor, int] | None = None  # sum and count of rows folded away
        self.first_bad: int | None = None  # the first step with a NaN/inf value, once found on the host

    def append(self, values: Sequence[torch.Tensor] | torch.Tensor, step: int) -> None:
        n = len(self.steps)
        if n == len(self.rows):
            if n >= self.limit:
                self._fold()
                n = 0
            else:
                self.rows = torch.cat([self.rows, torch.empty_like(self.rows)])
        with torch.no_grad():  # stack(out=) into the next row: one kernel, and no graph
            if isinstance(values, torch.Tensor):
                self.rows[n].copy_(values)
            elif self.scalars:
                torch.stack(values, out=self.rows[n])
            else:
                torch.stack([v.reshape(()).to(self.rows.dtype) for v in values], out=self.rows[n])
        self.steps.append(step)

    def __len__(self) -> int:
        return len(self.steps) + (self.folded[1] if self.folded else 0)

    def state_dict(self) -> dict[str, Any]:
        """The rows not yet written (as they are: the restored window sums the same values in the same order)."""
        folded = None if self.folded is None else (self.folded[0].cpu(), self.folded[1])
        return {"rows": self.rows[: len(self.steps)].cpu(), "steps": list(self.steps), "folded": folded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rows, self.steps = state["rows"], list(state["steps"])
        self.rows = torch.empty(max(8, 2 * len(rows)), rows.shape[1], device=self.rows.device, dtype=rows.dtype)
        self.rows[: len(rows)].copy_(rows)
        folded = state.get("folded")
        self.folded = None if folded is None else (folded[0].to(self.rows.device), int(folded[1]))

    def take(self) -> list[float]:
        """The mean of every row since the last take (one host read), noting the first non-finite step; then empty."""
        rows = self.rows[: len(self.steps)]
        total, count = rows.sum(0), len(self.steps)
        if self.folded is not None:
            total, count = total + self.folded[0], count + self.folded[1]
        flags = torch.isfinite(rows).all(1).logical_not()
        read = torch.cat([total / max(count, 1), flags.float()]).tolist()
        width = rows.shape[1]
        self._note_bad(read[width:])
        self.steps, self.folded = [], None
        return read[:width]

    def scan(self) -> int | None:
        """The first step with a NaN/inf value so far (one host read of the rows not yet taken)."""
        if self.first_bad is None and self.steps:
            self._note_bad(torch.isfinite(self.rows[: len(self.steps)]).all(1).logical_not().tolist())
        return self.first_bad

    def _note_bad(self, flags: list[float]) -> None:
        if self.first_bad is None:
            self.first_bad = next((s for s, bad in zip(self.steps, flags) if bad), None)

    def _fold(self) -> None:
        self.scan()
        rows = self.rows[: len(self.steps)]
        total, count = rows.sum(0), len(self.steps)
        if self.folded is not None:
            total, count = total + self.folded[0], count + self.folded[1]
        self.folded, self.steps = (total, count), []


class TrainingLog:
    """The recipe's training values since the last row, by group of names; and the step index every output names.

    ``step_index`` is Lightning's logging step: the index, from 0, of the training batch being
    trained — or of the optimizer step, for recipes that accumulate whole batches (Lightning is told
    their ``accumulate_grad_batches``). It is what ``metrics.csv``'s ``step`` column, the loss curves,
    the sample headers and the task-metric plot all say.
    """

    def __init__(self) -> None:
        self.groups: dict[tuple[str, ...], StepRows] = {}
        self.watched: set[tuple[str, ...]] = set()  # the loss groups the non-finite guard judges
        self.unjudged: list[tuple[tuple[str, ...], int]] = []  # watched rows added since the guard last looked
        self.step_index: int | None = None
        self.epoch: int | None = None  # the epoch of the last batch written into the rows (not the next one's)

    def add(
        self, names: tuple[str, ...], values: Sequence[torch.Tensor] | torch.Tensor, step: int, watched: bool = True
    ) -> None:
        """This step's ``values`` (scalars, or a 1-D tensor), one per name; ``watched``: a loss the guard judges."""
        rows = self.groups.get(names)
        if rows is None:
            device = values.device if isinstance(values, torch.Tensor) else values[0].device
            scalars = not isinstance(values, torch.Tensor) and all(
                v.dim() == 0 and v.dtype == torch.float32 for v in values
            )
            dtype = values.dtype if isinstance(values, torch.Tensor) and values.is_floating_point() else torch.float32
            rows = self.groups[names] = StepRows(len(names), device, scalars, dtype)
            if watched:
                self.watched.add(names)
        rows.append(values, step)
        if watched:
            self.unjudged.append((names, len(rows.steps) - 1))

    def state_dict(self) -> dict[str, Any]:
        """Each group's rows since the last log row: a run resumed mid-window writes the straight run's next row."""
        return {
            "groups": [
                {"names": list(names), "watched": names in self.watched, **rows.state_dict()}
                for names, rows in self.groups.items()
                if rows.steps or rows.folded
            ]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for group in state.get("groups", []):
            names = tuple(group["names"])
            rows = StepRows(len(names), torch.device("cpu"), dtype=group["rows"].dtype)
            rows.load_state_dict(group)
            self.groups[names] = rows
            if group["watched"]:
                self.watched.add(names)

    def to(self, device: torch.device) -> None:
        """Move the restored rows onto ``device`` (the module's, once it has one)."""
        for rows in self.groups.values():
            if rows.rows.device != device:
                rows.rows = rows.rows.to(device)
                if rows.folded is not None:
                    rows.folded = (rows.folded[0].to(device), rows.folded[1])

    def pop_new_loss_rows(self) -> list[torch.Tensor]:
        """The watched rows added since the last call (``nonfinite=skip`` judges a step by its own losses)."""
        taken = [self.groups[names].rows[i] for names, i in self.unjudged if i < len(self.groups[names].steps)]
        self.unjudged.clear()
        return taken

    def first_nonfinite(self, scan: bool = True) -> tuple[int, list[str]] | None:
        """The earliest step any watched value was NaN/inf, and the names of those values then.

        ``scan``: read the rows not yet written too (a host read); else only what the written rows showed.
        """
        found = [
            (rows.scan() if scan else rows.first_bad, names)
            for names, rows in self.groups.items()
            if names in self.watched
        ]
        found = [(step, names) for step, names in found if step is not None]
        if not found:
            return None
        step = min(s for s, _ in found)
        return step, [name for s, names in found if s == step for name in names]

    def write_row(self, trainer: L.Trainer) -> None:
        """Every group's means as one row to each logger, and into ``trainer.callback_metrics``.

        Written the way Lightning's LearningRateMonitor writes its rates (``logger.log_metrics`` at
        the logging step), not through ``self.log``. One host read per group; the learning rates the
        recipe adds on a row's batch (`multiloss.base.module.Recipe.log_learning_rates`) share the row.
        """
        row: dict[str, float] = {}
        for names, rows in self.groups.items():
            if rows.steps or rows.folded:
                row.update(zip(names, rows.take()))
        self.unjudged.clear()
        if not row:
            return
        # For callbacks that monitor a training loss (ModelCheckpoint(monitor=...), EarlyStopping), as
        # self.log would leave them.
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in row.items()})
        step = self.step_index if self.step_index is not None else 0
        for logger in trainer.loggers:
            # An integer, as Lightning's own rows write it; the rows' epoch, not the one the trainer counts after an
            # epoch's end (a run's last rows, written at its end, were epoch max_epochs - 1's, not max_epochs').
            epoch = self.epoch if self.epoch is not None else trainer.current_epoch
            logger.log_metrics({**row, "epoch": epoch}, step=step)


class TrainingLogWriter(LeanCallback):
    """Keeps a `TrainingLog`'s step index and writes its rows when Lightning writes its own (every recipe's)."""

    def __init__(self, log: TrainingLog) -> None:
        self.training_log = log

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Lightning counts this batch's step only after the batch (and a validation it runs) is over: the
        # index holds until the next batch ends, for the checkpoint, validation or epoch end in between.
        self.training_log.step_index = internals.batches_that_stepped(trainer)
        self.training_log.epoch = trainer.current_epoch
        # The last hook before Lightning writes a log row; a micro-batch that does not step writes none.
        if internals.writes_log_row(trainer) and internals.ends_accumulation(trainer):
            self.training_log.write_row(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.training_log.to(pl_module.device)  # rows a resumed checkpoint brought back, on the CPU until now

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The steps since the last row (a run shorter than log_every_n_steps has no other row).
        self.training_log.write_row(trainer)

    def state_dict(self) -> dict[str, Any]:
        return self.training_log.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.training_log.load_state_dict(state_dict)
