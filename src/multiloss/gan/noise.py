"""The GAN's training noise: its own generator, seeded with the run's seed, drawn for the global batch, checkpointed.

Not torch's global stream: Lightning's DDP re-seeds that at set-up (``reset_seed``) while a one-device run does not,
so 2 ranks × b would draw other noise than 1 × 2b. One draw of ``n × world_size`` rows a call, each rank keeping
every world_size-th row from its rank on (the way the data sampler shards the batch): drawing n per rank would give
every rank the same noise (their generators are seeded alike).
"""

from __future__ import annotations

import torch


class NoiseStream:
    def __init__(self, seed: int) -> None:
        self.seed = seed
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

    def rows(self, n: int, width: int, device: torch.device, rank: int, world: int) -> torch.Tensor:
        """This rank's ``n`` of ``n × world`` rows of ``width`` standard normals."""
        generator = self._generator if self._generator is not None else self.generator(device)  # one call a draw
        return torch.randn(n * world, width, generator=generator, device=device)[rank::world]

    def state(self) -> torch.Tensor | None:
        """The generator's state (a uint8 tensor: ``weights_only`` loads it), None before the first draw."""
        return self._generator.get_state() if self._generator is not None else None

    def load(self, state: torch.Tensor | None) -> None:
        """Continue from ``state`` (None: from the seed) at the next draw."""
        self._generator, self._state = None, state
