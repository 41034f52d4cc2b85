"""The GAN's training noise: its own generator, seeded with the run's seed, drawn for the global batch, checkpointed.

Not torch's global stream: Lightning's DDP re-seeds that at set-up (``reset_seed``) while a one-device run does not,
so 2 ranks × b would draw other noise than 1 × 2b. One draw of every rank's rows a call (the global micro-batch's
count, or n × world_size), each rank keeping every world_size-th row from its rank on (the way the data sampler shards
the batch): drawing n per rank would give every rank the same noise (their generators are seeded alike).

The normals are drawn element by element (uniforms through the inverse normal CDF, ``ndtri``), not by ``randn``,
whose CPU kernel transforms blocks of 16 values: a draw of 64 rows then equals draws of 32 + 32, or 17 + 47, so one
batch of N and k micro-batches of N together draw the same noise on any split, an epoch's ragged last one included.
A checkpoint of an earlier version, which drew by ``randn``, goes on drawing so (``draw``): it resumes as it ran.
"""

from __future__ import annotations

import torch


class NoiseStream:
    DRAWS = ("ndtri", "randn")

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.draw = "ndtri"  # each normal from its own uniform; "randn": an earlier version's checkpoint's
        self._generator: torch.Generator | None = None  # made on first use, on the module's device
        self._state: torch.Tensor | None = None  # from a checkpoint, applied when it is made

    def generator(self, device: torch.device) -> torch.Generator:
        """The generator, made on ``device`` at the first draw (from the seed, or the checkpoint's state)."""
        if self._generator is None:
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
            if self._state is not None:
                self._generator.set_state(self._state)
                self._state = None
        return self._generator

    def rows(
        self, n: int, width: int, device: torch.device, rank: int, world: int, total: int | None = None
    ) -> torch.Tensor:
        """This rank's ``n`` rows of one draw of ``total`` (every rank's; n × world by default) rows of ``width``
        standard normals: every ``world``-th from ``rank`` on. A rank left with fewer there (one that repeats an example
        only to take the step, its weight 0) takes the draw's first rows."""
        generator = self._generator if self._generator is not None else self.generator(device)  # one call a draw
        rows = n * world if total is None else total
        if self.draw == "ndtri":
            drawn = standard_normals(rows, width, generator, device)
        else:
            drawn = torch.randn(rows, width, generator=generator, device=device)
        mine = drawn[rank::world][:n]
        return mine if len(mine) == n else torch.cat([mine, drawn[: n - len(mine)]])

    def state(self) -> torch.Tensor | None:
        """The generator's state (a uint8 tensor: ``weights_only`` loads it), None before the first draw."""
        return self._generator.get_state() if self._generator is not None else None

    def load(self, state: torch.Tensor | None, draw: str = "ndtri") -> None:
        """Continue from ``state`` (None: from the seed) at the next draw, drawing as ``draw`` says."""
        self._generator, self._state = None, state
        self.draw = draw if draw in self.DRAWS else "ndtri"


def standard_normals(rows: int, width: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """``rows × width`` standard normals, each from its own uniform (float64, through ``ndtri``): the values of a
    draw do not depend on how the rows are split into draws. In the default dtype (float64 under ``64-true``)."""
    uniform = torch.rand(rows, width, generator=generator, device=device, dtype=torch.float64)
    return torch.special.ndtri(uniform.clamp_(min=2.0**-53)).to(torch.get_default_dtype())
