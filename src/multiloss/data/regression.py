"""A synthetic K-task regression whose task correlation is one number: the MMoE paper's construction.

Ma et al., "Modeling Task Relationships in Multi-task Learning with Multi-gate Mixture-of-Experts"
(KDD 2018), §3.2: task k's weight vector wₖ = c·(√ρ·u₀ + √(1-ρ)·uₖ) over orthonormal u₀ … u_K, so any
two tasks' weight vectors have cosine ρ (the paper's two tasks, generalised to K); the target is
yₖ = wₖ·x + Σₘ sin(αₘ·wₖ·x + βₘ) + ε with the sine frequencies and phases shared by the tasks. The
targets' Pearson correlation grows with ρ but is not ρ (the sines), as the paper notes.
"""

from __future__ import annotations

import torch

from multiloss.config import require
from multiloss.data.arrays import ArrayDataModule


class TaskRegressionDataModule(ArrayDataModule):
    """``n_examples`` inputs ``x`` (``in_features`` standard normal) and K targets ``y0`` … ``y{K-1}`` (float32).

    ``correlation`` ρ ∈ [0, 1] is the cosine between any two tasks' weight vectors (1: the same task K
    times, up to noise; 0: orthogonal tasks). ``scale`` is c, ``n_sines`` the number of shared sine
    terms (α, β ~ N(0, 1) as the paper's), ``noise`` ε's standard deviation. Everything is a pure
    function of ``data_seed`` (never of the training ``seed``). Tasks config: ``tasks=regression``
    (four tasks, ``experiment=task_regression``); for another K give ``n_tasks`` and one task (and
    head) per target.

    Raises:
        ConfigError: ``n_tasks`` < 1, ``correlation`` outside [0, 1], ``in_features`` ≤ ``n_tasks``
            (K + 1 orthonormal directions are needed), ``n_examples`` < 2, a negative ``noise``,
            ``n_sines`` < 0 or ``scale`` ≤ 0.
    """

    def __init__(
        self,
        n_tasks: int = 4,
        correlation: float = 0.5,
        in_features: int = 16,
        n_examples: int = 4000,
        scale: float = 1.0,
        n_sines: int = 10,
        noise: float = 0.01,
        data_seed: int = 0,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        require(n_tasks >= 1, "n_tasks", n_tasks, "an integer ≥ 1")
        require(0 <= correlation <= 1, "correlation", correlation, "a number in [0, 1] (the tasks' cosine)")
        require(in_features > n_tasks, "in_features", in_features, f"an integer > n_tasks ({n_tasks})")
        require(n_examples >= 2, "n_examples", n_examples, "an integer ≥ 2")
        require(scale > 0, "scale", scale, "a positive number")
        require(n_sines >= 0, "n_sines", n_sines, "an integer ≥ 0")
        require(noise >= 0, "noise", noise, "a number ≥ 0 (the targets' noise std)")
        self.n_tasks, self.correlation, self.in_features = n_tasks, correlation, in_features
        self.n_examples = n_examples
        self.scale, self.n_sines, self.noise, self.data_seed = scale, n_sines, noise, data_seed

    def task_weights(self) -> torch.Tensor:
        """The K weight vectors, shape (K, in_features), pairwise cosine ``correlation``, norm ``scale``."""
        gen = torch.Generator().manual_seed(self.data_seed)
        u, _ = torch.linalg.qr(torch.randn(self.in_features, self.n_tasks + 1, generator=gen, dtype=torch.float64))
        shared, own = u[:, 0], u[:, 1:].T
        rho = self.correlation
        return self.scale * (rho**0.5 * shared + (1 - rho) ** 0.5 * own)

    def load(self) -> dict[str, torch.Tensor]:
        w = self.task_weights()
        # A private generator, seeded past the weights' draw: the data never moves the global stream.
        gen = torch.Generator().manual_seed(self.data_seed + 1)
        x = torch.randn(self.n_examples, self.in_features, generator=gen, dtype=torch.float64)
        alpha = torch.randn(self.n_sines, generator=gen, dtype=torch.float64)
        beta = torch.randn(self.n_sines, generator=gen, dtype=torch.float64)
        projected = x @ w.T  # (n, K)
        y = projected + torch.sin(alpha * projected[..., None] + beta).sum(-1)
        y = y + self.noise * torch.randn(y.shape, generator=gen, dtype=torch.float64)
        return {"x": x.float(), **{f"y{k}": y[:, k].float() for k in range(self.n_tasks)}}
