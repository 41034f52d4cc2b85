"""Sample quality that runs offline: FID, KID, precision/recall/density/coverage, stacked-digit modes.

All in one feature space: the shipped digits classifier's hidden layer (`multiloss.gan.digit_features`, versioned)
by default, or Inception's (``feature: inception``: torchmetrics' own network, where its weights are present).
FID and KID are torchmetrics' (``FrechetInceptionDistance`` / ``KernelInceptionDistance`` with ``feature=`` the
module); precision, recall, density and coverage (Naeem et al. 2020) are the authors' ``prdc`` package
computed on the features torchmetrics gathers from every rank. Everything here is a torchmetrics state: each rank
updates with its own validation batches, and ``compute`` (called by every rank) sees all of them.
"""

from __future__ import annotations

import contextlib
import io
import math
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric
from torchmetrics.image.fid import FrechetInceptionDistance
from torchmetrics.image.kid import KernelInceptionDistance
from torchmetrics.utilities import dim_zero_cat

from multiloss.base.metrics import ModeCoverage
from multiloss.config import ConfigError, require, require_options
from multiloss.gan.digit_features import PIXELS, VERSION, DigitFeatures

FEATURES = ("digits", "inception")


class PRDC(Metric):
    """Precision, recall, density and coverage (``prdc.compute_prdc``, k nearest neighbours) of generated features
    against real ones, gathered over the ranks."""

    full_state_update = False

    def __init__(self, feature: nn.Module, nearest_k: int = 5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.feature, self.nearest_k = feature, nearest_k
        self.add_state("real", default=[], dist_reduce_fx="cat")
        self.add_state("fake", default=[], dist_reduce_fx="cat")

    def update(self, samples: torch.Tensor, real: bool) -> None:
        (self.real if real else self.fake).append(self.feature(samples).double())

    def compute(self) -> dict[str, torch.Tensor]:
        from prdc import compute_prdc

        real, fake = dim_zero_cat(self.real).cpu().numpy(), dim_zero_cat(self.fake).cpu().numpy()
        with contextlib.redirect_stdout(io.StringIO()):  # it prints the sample counts
            scores = compute_prdc(real, fake, self.nearest_k)
        return {name: torch.tensor(float(value)) for name, value in scores.items()}


class StackedModes(Metric):
    """Stacked digits (k digits a sample: 10^k modes): how many modes the generated samples hit (each digit
    classified by the shipped classifier) and KL(generated modes ‖ uniform), as the StackedMNIST papers report."""

    full_state_update = False

    def __init__(self, classifier: DigitFeatures, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.classifier = classifier
        self.n_modes = 10**classifier.digits_per_sample
        self.add_state("counts", default=torch.zeros(self.n_modes, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, samples: torch.Tensor) -> None:
        classes = self.classifier.classify(samples)
        powers = 10 ** torch.arange(classes.shape[1] - 1, -1, -1, device=classes.device)
        self.counts += torch.bincount((classes * powers).sum(dim=1), minlength=self.n_modes)

    def compute(self) -> dict[str, torch.Tensor]:
        p = self.counts.double() / self.counts.sum().clamp(min=1)
        hit = p > 0
        kl = (p[hit] * (p[hit] * self.n_modes).log()).sum()
        return {"modes": hit.sum(), "kl_modes": kl}


def _to_images(x: torch.Tensor) -> torch.Tensor:
    """Digit samples as 3-channel images in [0, 1] for Inception: (N, 3, H, W), a grey channel repeated."""
    side = math.isqrt(x[0].numel())
    images = x.reshape(len(x), 1, side, side) if x.dim() < 4 else x
    return images.clamp(0, 1).expand(-1, 3, -1, -1).float()


class _InceptionOnImages(nn.Module):
    """torchmetrics' default Inception on digit samples (made images first)."""

    def __init__(self, inception: nn.Module) -> None:
        super().__init__()
        self.inception = inception
        self.num_features = 2048

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inception((_to_images(x) * 255).byte())


OPTIONS = ("feature", "kid_subset_size", "kid_subsets", "nearest_k", "stacked_modes", "seed")  # model.metrics'


def check_options(options: dict | None) -> None:
    """``model.metrics`` checked as far as it can be before the data's sample shape is known (null: off)."""
    if options is not None:
        require_options(options, "metrics", OPTIONS)
        feature = options.get("feature", "digits")
        require(feature in FEATURES, "metrics.feature", feature, ", ".join(FEATURES))


class SampleQuality(nn.Module):
    """The GAN's offline quality metrics (``model.metrics``): ``update(samples, real)`` per validation batch,
    ``compute()`` → {fid, kid, kid_std, precision, recall, density, coverage[, modes, kl_modes]}.

    Raises:
        ConfigError: ``feature`` not one of ``FEATURES``; ``kid_subset_size`` or ``nearest_k`` < 1; samples that are
            not k digits (k · 64 values) with ``feature=digits``; ``feature=inception`` without its weights.
    """

    def __init__(
        self,
        sample_shape: tuple[int, ...],
        feature: str = "digits",
        kid_subset_size: int = 100,
        kid_subsets: int = 10,
        nearest_k: int = 5,
        stacked_modes: bool | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        require(feature in FEATURES, "metrics.feature", feature, ", ".join(FEATURES))
        require(kid_subset_size >= 1, "metrics.kid_subset_size", kid_subset_size, "an integer ≥ 1")
        require(kid_subsets >= 1, "metrics.kid_subsets", kid_subsets, "an integer ≥ 1")
        require(nearest_k >= 1, "metrics.nearest_k", nearest_k, "an integer ≥ 1")
        values = math.prod(sample_shape)
        if len(sample_shape) == 3 and sample_shape[1] == sample_shape[2] and sample_shape[1] % 8 == 0:
            values = sample_shape[0] * PIXELS  # k enlarged digits (stacked digits at data.resolution): k digits
        if feature == "digits":
            require(
                values % PIXELS == 0,
                "metrics.feature",
                feature,
                "samples of k digits (k · 64 values in [0, 1]: data=digits, data=stacked_digits), or feature=inception",
                f"the data's samples have shape {sample_shape}",
            )
            extractor: nn.Module = DigitFeatures(values // PIXELS)
        else:
            try:
                inception = FrechetInceptionDistance(feature=2048).inception
            except (ModuleNotFoundError, RuntimeError, OSError) as err:
                raise ConfigError(
                    "metrics.feature",
                    feature,
                    "digits, or inception where torch-fidelity and its weights are",
                    str(err),
                ) from None
            extractor = _InceptionOnImages(inception)
        self.feature, self.version = feature, VERSION if feature == "digits" else None
        self.kid_subset_size, self.kid_subsets, self.seed = kid_subset_size, kid_subsets, seed
        self.fid = FrechetInceptionDistance(feature=extractor)
        self.kid = KernelInceptionDistance(feature=extractor, subsets=kid_subsets, subset_size=kid_subset_size)
        self.prdc = PRDC(extractor, nearest_k)
        digits = values // PIXELS if feature == "digits" else 0
        self.modes = StackedModes(extractor) if (stacked_modes or (stacked_modes is None and digits > 1)) else None

    def update(self, samples: torch.Tensor, real: bool) -> None:
        for metric in (self.fid, self.kid, self.prdc):
            metric.update(samples, real=real)
        if not real and self.modes is not None:
            self.modes.update(samples)

    def compute(self) -> dict[str, torch.Tensor]:
        """Every metric, each rank's samples gathered (called by every rank); KID's subsets at most the samples."""
        n = min(int(self.fid.real_features_num_samples), int(self.fid.fake_features_num_samples))
        self.kid.subset_size = max(2, min(self.kid_subset_size, n))
        scores = {"fid": self.fid.compute()}
        # KID's subsets are drawn from torch's global stream: drawn from `seed` instead, the same checkpoint and data
        # score the same at a run's validation and in multiloss-eval (on every rank), and training's stream is kept.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            scores["kid"], scores["kid_std"] = self.kid.compute()
        scores.update(self.prdc.compute())
        if self.modes is not None:
            scores.update(self.modes.compute())
        return {name: value.float() for name, value in scores.items()}

    def reset(self) -> None:
        for metric in (self.fid, self.kid, self.prdc, self.modes):
            if metric is not None:
                metric.reset()


class ValidationScores:
    """What a GAN's validation scores beyond its losses: the modes of a Gaussian mixture the samples hit, and the
    quality metrics of ``model.metrics`` (`SampleQuality`). Built at set-up from the data's first batch, kept out of
    the module tree (the feature network's weights are the shipped ones, not the run's: no checkpoint holds them)."""

    def __init__(self, spec: dict | None, seed: int) -> None:
        self.spec, self.seed = spec, seed
        self.quality: SampleQuality | None = None
        self.mode_coverage: ModeCoverage | None = None

    def build(self, sample_shape: tuple[int, ...], datamodule: Any, device: torch.device) -> None:
        """Made once, for samples of ``sample_shape``; mode coverage where the data has modes (``centers``)."""
        if self.spec is not None and self.quality is None:
            try:
                # KID's subsets drawn from the run's seed unless model.metrics.seed says otherwise.
                self.quality = SampleQuality(sample_shape, **{"seed": self.seed, **self.spec}).to(device)
            except ConfigError as err:
                raise err.under("model") from None
        if (centers := getattr(datamodule, "centers", None)) is not None and self.mode_coverage is None:
            self.mode_coverage = ModeCoverage(centers, datamodule.std).to(device)

    def update(self, real: torch.Tensor, fake: torch.Tensor) -> None:
        if self.mode_coverage is not None:
            self.mode_coverage.update(fake)
        if self.quality is not None:
            self.quality.update(real, real=True)
            self.quality.update(fake, real=False)

    def compute(self) -> dict[str, torch.Tensor]:
        """Every score, then reset; called by every rank (the metrics gather their states), whatever its batches."""
        scores: dict[str, torch.Tensor] = {}
        for metric in (self.mode_coverage, self.quality):
            if metric is not None:
                scores.update(metric.compute())
                metric.reset()
        return scores

    def log(self, module: Any, prefix: str) -> None:
        """Every score (`compute`, on every rank) logged under ``prefix``. Equal on every rank already: nothing to
        reduce (``rank_zero_only`` makes Lightning's reduction a no-op, no collective for one rank to issue alone;
        ``sync_dist`` keeps its warning off)."""
        for name, value in self.compute().items():
            shown = name in ("modes", "high_quality", "fid")
            module.log(f"{prefix}/{name}", value, prog_bar=shown, sync_dist=True, rank_zero_only=True)
