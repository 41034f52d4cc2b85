"""Recipe `gan`: two networks, two optimizers, one shared tensor between them — cut it with detach().

A GAN needs two backward passes per step, the discriminator's and the generator's, and both losses
are built on the same generated samples. The classic mistake: compute ``fake = G(z)``, backward
the discriminator's loss on ``fake`` itself, step D, then backward the generator's loss through the
same ``fake``. The second backward raises

    RuntimeError: Trying to backward through the graph a second time (or directly access saved
    tensors after they have already been freed). ...

and, worse because silent, the first backward has already written D's loss into the generator's
``.grad`` (a push toward fakes that are *easier* to spot). ``retain_graph=True`` silences the
error and keeps the wrong gradient, unless G's gradients happen to be zeroed in between. The cure
is ``fake.detach()`` in the discriminator's loss: two separate graphs, each backward reaching only
its own network.

The second trap is the order. Build the generator's loss (a forward through D) *before*
``opt_d.step()`` and backward it after, and autograd refuses:

    RuntimeError: one of the variables needed for gradient computation has been modified by an
    inplace operation: [torch.FloatTensor [128, 1]], which is output 0 of AsStrided, is at version 2;
    expected version 1 instead. ...

because the optimizer updated D's weights in place under a graph that had saved them. So a step
here is: D's loss on detached fakes, D's backward and step, *then* G's loss through the updated D.
``tests/recipes/test_gan.py`` shows both failing alternatives on this module.

Each backward touches one network only: D's under ``toggle_optimizer(opt_d)`` (G's weights do not
require grad, and the fakes are detached anyway), G's under ``toggle_optimizer(opt_g)`` (the
gradient flows *through* D to the fakes, but D's weights do not require grad there and get no
``.grad``). So every backward's gradients belong to exactly one optimizer. (Stock DDP, which wraps
the whole module and waits for every parameter's gradient, still needs
``trainer.strategy=ddp_find_unused_parameters_true``; the split is what lets a leaner sync do
without it.)

A gradient penalty (WGAN-GP's, R1, R2) is the other double backward here: ‖∇ₓD(x)‖ is itself a
function of D's weights, so ``torch.autograd.grad(..., create_graph=True)`` keeps the graph of that
gradient to differentiate it again; without ``create_graph`` the penalty is a constant to autograd
and D's weights silently get no gradient from it (a finite-difference check in the tests).

    python train.py recipe=gan                     # WGAN-GP on 8 Gaussians on a ring
    python train.py recipe=gan data=gaussians25    # 25 on a grid
    python train.py recipe=gan model.loss=nonsaturating model.penalty=none model.n_critic=1
    python train.py recipe=gan model.loss=relativistic model.penalty=r1 model.penalty_weight=0.05 model.penalty_every=16
    python train.py recipe=gan data=digits model.data_dim=64 model.latent_dim=16
    python train.py --config-dir my_configs recipe=gan generator=my_gen discriminator=my_critic
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import lightning as L
import torch
from torch import nn

from multiloss.base.module import Recipe
from multiloss.base.precision import grad_scaler
from multiloss.batches import require_keys
from multiloss.callbacks import GeneratedSamplesPlot
from multiloss.component_check import call_component, describe_output
from multiloss.components import build_module, build_optimizer_factory, names_given_as_objects, to_plain
from multiloss.config import ConfigError, require
from multiloss.gan.augment import build_augment
from multiloss.gan.ema import GeneratorEMA
from multiloss.gan.metrics import SampleQuality
from multiloss.gan.metrics import check_options as check_quality_options
from multiloss.gan.objectives import (
    LOSSES,
    PAIRED,
    PENALTIES,
    correct_betas,
    discriminator_terms,
    lazy_ratio,
    penalty,
    squared_norm_penalty,
)
from multiloss.gan.objectives import generator_loss as generator_loss_of
from multiloss.metrics import ModeCoverage
from multiloss.parallel.ddp import synced
from multiloss.saving.saved_state import D_STEPS_KEY, NOISE_KEY


def _batch_norms(module: nn.Module) -> list[str]:
    """The names of ``module``'s BatchNorm layers."""
    kinds = (
        nn.BatchNorm1d,
        nn.BatchNorm2d,
        nn.BatchNorm3d,
        nn.SyncBatchNorm,
        nn.LazyBatchNorm1d,
        nn.LazyBatchNorm2d,
        nn.LazyBatchNorm3d,
    )
    return [name or "(itself)" for name, m in module.named_modules() if isinstance(m, kinds)]


@dataclass
class _DMicroBatch:
    """What one micro-batch of D's step used: G's lazy-penalty step, same_z and the relativistic pairing reuse it."""

    z: torch.Tensor
    real: torch.Tensor
    fake: torch.Tensor  # detached
    eps: torch.Tensor


class GAN(Recipe):
    """GAN: a generator and a discriminator, two optimizers, detached fakes, n_critic D steps per G step.

    Components:
        generator (group ``generator``, default ``mlp``: `multiloss.nets.MLP` from ``latent_dim`` to
            ``data_dim`` features): ``generator(z)`` with ``z`` of shape ``(batch, latent_dim)``
            returns samples of the data's sample shape (checked at setup).
        discriminator (group ``discriminator``, default ``mlp``): ``discriminator(x)`` returns one
            score (a logit; with ``loss=bce`` a probability) per sample, shape ``(batch,)`` or
            ``(batch, 1)``. No BatchNorm with a ``penalty`` (the penalty needs each sample's own
            gradient; refused at setup); without a penalty BatchNorm is fine (DCGAN's), though split
            batches then stop being one batch.
        g_optimizer, d_optimizer (options of the ``optimizer`` group, default ``adam_gan``).
        scheduler (group ``scheduler``, default ``linear_decay``): one schedule per optimizer.
        data: batches with ``x`` (real samples, any shape); ``(x,)`` / ``(x, y)`` tuples too.

    ``latent_dim`` is the noise's width; ``data_dim`` is read by the shipped ``mlp`` options only
    (``${model.data_dim}`` in their configs): the recipe itself takes the sample shape from the data.

    The step (``training_step``, two optimizers, ``model.g_optimizer`` and ``model.d_optimizer``, each
    picked from the ``optimizer`` group: ``optimizer@model.d_optimizer=sgd``): per training batch, one
    discriminator (critic) micro-batch on the real batch and as many generated points, detached, with
    only D's weights requiring grad (``toggle_model``); its loss divided by ``accumulate_grad_batches``
    = k, and every k-th batch (and an epoch's last) D's clipping, step and zeroing. Then, right after
    D has stepped, a generator step of k micro-batches through the updated D, with only G's weights
    requiring grad — after every ``n_critic``-th D step (``g_step_after=last``, the WGAN-GP paper's
    Algorithm 1), after the first of every ``n_critic`` (``first``, PyTorch-GAN's ``i % n_critic ==
    0``: batches 0, n, 2n, ... of each epoch), or before the group's first D micro-batch (``before``,
    stylegan2-ada's phase order Gmain, Dmain, Dreg; fresh noise only; the relativistic G pairs with the batch's
    reals). G's input, ``g_input``: ``fresh`` noise (Algorithm 1),
    ``same_z`` — G run again on the noise of the D step just taken (PyTorch-GAN; under k, micro-batch
    i on the noise of D's micro-batch i) — or ``same_fakes`` — G's loss through the very fakes D scored
    detached, one G forward a batch, its graph kept from D's micro-batch to G's step (DCGAN, and every
    tutorial's ``fake.detach()`` example; k = 1 only). Under DDP each network syncs only its own
    step's last micro-batch, whichever noise it runs on. Each schedule follows its optimizer's steps
    (the default ``linear_decay``: both rates fall linearly to 0 by ``trainer.max_epochs``, one step
    per epoch; ``scheduler=constant`` keeps them). ``trainer.max_steps`` counts both optimizers' steps (not the
    lazy penalty's extra D steps).

    Losses (``loss``; formulas in `multiloss.gan.objectives.discriminator_terms`): ``nonsaturating`` (on D's
    logits), ``bce`` (the same function on D's probabilities — a D that ends in a Sigmoid — as dcgan/main.py writes
    it: ``nn.BCELoss`` against labels 1 and 0, D's real and fake terms backwarded one after the other; the DCGAN
    script to the bit, where the logits form drifts from it by rounding), ``wgan-gp`` (the Wasserstein critic),
    ``hinge``, ``lsgan`` and ``relativistic`` (RpGAN: each generated sample against the real sample of its row; G's
    step scores the reals of D's matching micro-batch once more).

    Penalties (``penalty``, weight ``penalty_weight``; `multiloss.gan.objectives.penalty`): ``gp``, λ·E[(‖∇D(x̂)‖ −
    1)²] at random interpolates x̂ (WGAN-GP); ``r1``, γ/2·E[‖∇D(x)‖²] on the data; ``r2``, the same on the generated
    samples; ``none``. ``penalty_every`` = 1 adds it to every D step's loss (R1/R2 from the scores the loss is built
    from: stylegan2-ada's ``Dboth``); N > 1 is stylegan2-ada's lazy
    regularization: after every N-th D step one more D step of the penalty alone at N times its weight, on that
    D step's samples, with D's optimizer corrected once at the start as stylegan2-ada does (lr × N/(N+1), each beta
    to the power N/(N+1)). Under ``16-mixed`` the input gradient is taken on the GradScaler's scaled scores and
    unscaled before the penalty (PyTorch's AMP recipe for gradient penalties).

    The training noise comes from the module's own generator, seeded with ``noise_seed`` (``${seed}``
    in the config) and saved in every checkpoint, drawn for the whole global batch and sharded like the
    data: so k micro-batches of b draw what one batch of k·b draws, and so do 2 ranks × b and 1 rank ×
    2b (on CPU, for b a multiple of 16), and a resumed run draws what the uninterrupted one did. Not
    torch's global stream: Lightning's DDP re-seeds that at setup (``reset_seed``) while a one-device
    run keeps what model initialisation left of it, so the two would draw different noise from the
    same seed.

    Generator EMA (``g_ema``, off when null; `multiloss.gan.ema`): a frozen copy of G, moved toward G after
    each G step — ``{half_life_images: h, rampup: r}`` (stylegan2-ada: a half-life in real images shown to D, all
    ranks and micro-batches counted) or ``{decay: β, start_step: s}`` (StudioGAN) — its buffers copied from G.
    Validation, the sample plots, ``multiloss-eval`` and ``forward`` (so a ``load_from_checkpoint`` module) sample
    from it; it and its image count are in every checkpoint; sharded like G under FSDP2.

    Logs per step ``loss/d`` (= its terms ``loss/d_real`` + ``loss/d_fake``, or ``loss/d_pair``, + the weighted
    penalty ``loss/<penalty>``, which a lazy one logs on its own steps) and, on generator steps, ``loss/g``; per
    epoch ``val/loss/d``, ``val/loss/g`` and, on Gaussian-mixture data,
    ``val/modes`` (modes hit) and ``val/high_quality`` (share of samples within 3σ of a mode) from
    a fixed evaluation noise. Writes ``samples/epoch_<n>.png`` (``n_plot_samples`` points) into the run
    dir at every epoch end (`multiloss.callbacks.GeneratedSamplesPlot`).

    Raises:
        ConfigError: ``loss`` not one of ``LOSSES``; ``n_critic``, ``accumulate_grad_batches``, ``latent_dim`` or
            ``data_dim`` < 1;
            ``penalty_every`` < 1; ``penalty`` not one of gp, r1, r2, none, or none with ``loss=wgan-gp``;
            ``penalty_weight`` ≤ 0 with a penalty; ``penalty_every`` > 1 without one; ``n_plot_samples`` < 0;
            ``g_input=same_fakes`` with ``accumulate_grad_batches`` > 1; the step options' checks
            (`multiloss.base.module.Recipe`); at setup (before any step or write), a discriminator with BatchNorm and a
            penalty, a generator whose
            samples do not have the data's shape (with the shipped ``mlp``: set ``model.data_dim`` to the
            data's feature count), a discriminator that does not give one score per sample, or (``loss=bce``)
            scores outside [0, 1]. A single
            ``model.optimizer`` (``optimizer=sgd``) is an unknown key: the GAN has two.
    """

    # Under multiloss's DDP each network gets its own wrapper, so a backward that reaches only one of
    # them (every backward here) finds exactly the parameters DDP waits for: no
    # find_unused_parameters=True graph walk (src/multiloss/parallel/ddp.py).
    ddp_submodules = ("generator", "discriminator")
    components: ClassVar[tuple[str, ...]] = ("generator", "discriminator")
    validation_loss = None  # no single loss to watch: scheduler=plateau needs model.scheduler.monitor
    validation_metrics = ("val/loss/d", "val/loss/g", "val/modes (on the Gaussian mixtures, with mode=max)")

    def __init__(
        self,
        generator: Any,
        discriminator: Any,
        g_optimizer: Any = None,
        d_optimizer: Any = None,
        loss: Literal["nonsaturating", "bce", "wgan-gp", "hinge", "lsgan", "relativistic"] = "nonsaturating",
        n_critic: int = 1,
        penalty: Literal["gp", "r1", "r2", "none"] = "none",
        penalty_weight: float = 0.0,
        penalty_every: int = 1,
        latent_dim: int = 2,
        data_dim: int = 2,
        n_plot_samples: int = 1000,
        noise_seed: int = 0,
        g_input: Literal["fresh", "same_fakes", "same_z"] = "fresh",
        g_step_after: Literal["last", "first", "before"] = "last",
        g_ema: dict[str, Any] | None = None,
        augment: dict[str, Any] | None = None,
        metrics: dict[str, Any] | None = None,
        gp_weight: float | None = None,  # before penalty/penalty_weight: read from older checkpoints' hyperparameters
        **step_options: Any,  # the options of every recipe's step (multiloss.base.module.Recipe)
    ) -> None:
        super().__init__(**step_options)
        if gp_weight is not None:  # the one-key form of older runs: gp_weight=λ was penalty=gp at λ (0: none)
            require(
                penalty in ("gp", "none"),
                "gp_weight",
                gp_weight,
                f"unset with model.penalty={penalty} (gp_weight=<λ> is model.penalty=gp model.penalty_weight=<λ>)",
            )
            penalty, penalty_weight = ("gp" if gp_weight else "none"), gp_weight
        for key, value in (
            ("n_critic", n_critic),
            ("latent_dim", latent_dim),
            ("data_dim", data_dim),
            ("penalty_every", penalty_every),
        ):
            require(isinstance(value, int) and value >= 1, key, value, "an integer ≥ 1")
        require(loss in LOSSES, "loss", loss, ", ".join(LOSSES))
        require(penalty in PENALTIES, "penalty", penalty, ", ".join(PENALTIES))
        require(
            penalty_weight > 0 if penalty != "none" else penalty_weight >= 0,
            "penalty_weight",
            penalty_weight,
            f"a positive number with penalty={penalty} (λ for gp, γ for r1/r2), or model.penalty=none",
        )
        require(
            loss != "wgan-gp" or penalty != "none",
            "penalty",
            penalty,
            "gp (or r1/r2) with loss=wgan-gp (the Wasserstein critic needs a penalty to stay Lipschitz: "
            "model.penalty=gp model.penalty_weight=0.1), or another model.loss",
        )
        require(
            penalty_every == 1 or penalty != "none",
            "penalty_every",
            penalty_every,
            "1 with penalty=none (it is the lazy penalty's interval)",
        )
        require(n_plot_samples >= 0, "n_plot_samples", n_plot_samples, "an integer ≥ 0 (0 = no sample plots)")
        require(g_input in ("fresh", "same_fakes", "same_z"), "g_input", g_input, "fresh, same_fakes or same_z")
        require(g_step_after in ("last", "first", "before"), "g_step_after", g_step_after, "last, first or before")
        require(
            g_step_after != "before" or g_input == "fresh",
            "g_input",
            g_input,
            "fresh with g_step_after=before (G steps before D has drawn its noise or scored its fakes)",
        )
        require(
            g_input != "same_fakes" or self.accumulate_grad_batches == 1,
            "g_input",
            g_input,
            f"fresh or same_z with model.accumulate_grad_batches={self.accumulate_grad_batches} (same_z runs G again "
            "on each micro-batch's noise), or model.accumulate_grad_batches=1",
            "same_fakes keeps G's graph from D's micro-batch to G's step: k batches' graphs at once",
        )
        generator, discriminator = to_plain(generator), to_plain(discriminator)
        g_optimizer, d_optimizer = to_plain(g_optimizer), to_plain(d_optimizer)
        given = names_given_as_objects(
            generator=generator, discriminator=discriminator, g_optimizer=g_optimizer, d_optimizer=d_optimizer
        )
        self.save_hyperparameters(ignore=given, logger=False)
        self.g_optimizer_factory = build_optimizer_factory(g_optimizer, "g_optimizer")
        self.d_optimizer_factory = build_optimizer_factory(d_optimizer, "d_optimizer")
        self.loss, self.n_critic = loss, n_critic
        self.penalty, self.penalty_weight, self.penalty_every = penalty, penalty_weight, penalty_every
        self.latent_dim, self.n_plot_samples, self.noise_seed = latent_dim, n_plot_samples, noise_seed
        self.g_input, self.g_step_after = g_input, g_step_after
        self._d_micro: list[_DMicroBatch] = []  # the D step's micro-batches so far (same_z, relativistic, lazy)
        self.d_steps = 0  # D's (counted) steps so far, checkpointed: the lazy penalty's phase
        self._noise: torch.Generator | None = None  # made on first use, on the module's device
        self._noise_state: torch.Tensor | None = None  # from a checkpoint, applied when it is made

        self.generator = build_module(generator, "generator")
        self.discriminator = build_module(discriminator, "discriminator")
        # The average sits beside G: sharded like it under FSDP2 (a component of its own), never wrapped by DDP (it
        # is not trained; the ranks' copies stay equal because their G's do).
        self.generator_ema = GeneratorEMA.from_options(self.generator, to_plain(g_ema))
        if self.generator_ema is not None:
            self.components = (*self.components, "generator_ema")
        self.augment = build_augment(to_plain(augment))  # what D sees in training (multiloss.gan.augment)
        self.metrics_spec = to_plain(metrics)
        check_quality_options(self.metrics_spec)
        # Built at setup (it needs the data's sample shape), and kept out of the module tree: its feature network's
        # weights are the shipped ones, not the run's, so neither a checkpoint nor load_from_checkpoint holds them.
        self._quality: SampleQuality | None = None
        self.sample_shape: tuple[int, ...] | None = None  # a data sample's shape, seen by the component check
        self.mode_coverage: ModeCoverage | None = None  # made by the component check when the data has modes
        self._eval_noise: torch.Generator | None = None  # set at every validation epoch's start

    def held_whole(self, trainer: L.Trainer) -> tuple[str, ...]:
        # The penalty differentiates ∇D(x) again (create_graph): a double backward through the critic.
        return ("discriminator",) if self.penalty != "none" else ()

    def not_compilable(self, name: str) -> str:
        if name == "discriminator" and self.penalty != "none":
            return "the gradient penalty differentiates its gradient, a double backward torch.compile does not support"
        return ""

    def lr_rule(self, optimizer: Any) -> tuple[float, dict[str, Any]]:
        # The lazy penalty's extra D step: stylegan2-ada's lr × N/(N+1) (its betas: configure_optimizers).
        if self.penalty_every > 1 and optimizer.param_groups[0].get("name") == "discriminator":
            return lazy_ratio(self.penalty_every), {"model.penalty_every": self.penalty_every}
        return 1.0, {}

    def configure_optimizers(self) -> list[Any]:
        for key, factory in (("g_optimizer", self.g_optimizer_factory), ("d_optimizer", self.d_optimizer_factory)):
            if factory is None:
                raise ConfigError(
                    f"model.{key}", None, "an optimizer config (optimizer@model.{key}=adam_gan)", "not set"
                )
        # Named param groups: LearningRateMonitor logs `lr-<Optimizer>/generator` and `.../discriminator`.
        opt_g = self.g_optimizer_factory([{"params": self.generator.parameters(), "name": "generator"}])
        opt_d = self.d_optimizer_factory([{"params": self.discriminator.parameters(), "name": "discriminator"}])
        if self.penalty_every > 1:
            correct_betas(opt_d, lazy_ratio(self.penalty_every))
        return [self.with_schedule(opt_g, "model.g_optimizer"), self.with_schedule(opt_d, "model.d_optimizer")]

    def output_callbacks(self) -> list[L.Callback]:
        return [GeneratedSamplesPlot(self.n_plot_samples)] if self.n_plot_samples else []

    def check_components(self, batch: dict[str, Any]) -> None:
        require_keys(batch, ("x",), "the real samples")
        real = batch["x"]
        # On the data's device: at setup Lightning reports the target device while the weights are still on the CPU.
        z = torch.randn(len(real), self.latent_dim, generator=torch.Generator().manual_seed(0)).to(real.device)
        gen, critic = self.component_name("generator"), self.component_name("discriminator")
        fake = call_component("model.generator", gen, self.generator, z, given=f"z: {describe_output(z)}")
        if not isinstance(fake, torch.Tensor) or fake.shape != real.shape:
            raise ConfigError(
                "model.generator",
                gen,
                f"a generator whose samples have the data's sample shape {tuple(real.shape[1:])} "
                f"(from z of model.latent_dim={self.latent_dim}); with the shipped mlp, set model.data_dim="
                f"{real[0].numel()} (e.g. python train.py recipe=gan data=digits model.data_dim=64)",
                f"for {len(real)} latent vectors it returned {describe_output(fake)}",
            )
        for what, x in (("real", real), ("generated", fake)):
            scores = call_component(
                "model.discriminator", critic, self.discriminator, x, given=f"{what} samples {describe_output(x)}"
            )
            if not isinstance(scores, torch.Tensor) or scores.numel() != len(x) or scores.shape[0] != len(x):
                raise ConfigError(
                    "model.discriminator",
                    critic,
                    "a discriminator that returns one score per sample, shape (batch,) or (batch, 1)",
                    f"for {what} samples {describe_output(x)} it returned {describe_output(scores)}",
                )
            if self.loss == "bce" and not bool(((scores >= 0) & (scores <= 1)).all()):
                raise ConfigError(
                    "model.discriminator",
                    critic,
                    "a discriminator that ends in a Sigmoid (probabilities in [0, 1]) with model.loss=bce, or "
                    "model.loss=nonsaturating for one that returns logits (the same loss, on logits)",
                    f"for {what} samples its scores reach {float(scores.min()):.3g}..{float(scores.max()):.3g}",
                )
        if self.penalty != "none" and (norms := _batch_norms(self.discriminator)):
            raise ConfigError(
                "model.discriminator",
                critic,
                f"a discriminator without BatchNorm with model.penalty={self.penalty} (the penalty needs each "
                "sample's own gradient ∇D(x), and BatchNorm mixes a batch's samples), or model.penalty=none "
                "(DCGAN's loop)",
                f"it has BatchNorm: {', '.join(norms[:3])}",
            )
        self.sample_shape = tuple(real.shape[1:])
        if self.augment is not None:
            self.augment.set_sample_shape(self.sample_shape)
        if self.metrics_spec is not None and self._quality is None:
            try:
                # KID's subsets drawn from the run's seed unless model.metrics.seed says otherwise.
                spec = {"seed": self.noise_seed, **self.metrics_spec}
                quality = SampleQuality(self.sample_shape, **spec).to(real.device)
                object.__setattr__(self, "_quality", quality)  # not a submodule (see __init__)
            except ConfigError as err:
                raise err.under("model") from None
        # Mode coverage where the data has modes (the Gaussian mixtures), scored at every validation.
        datamodule = self.attached_datamodule
        if (centers := getattr(datamodule, "centers", None)) is not None and self.mode_coverage is None:
            self.mode_coverage = ModeCoverage(centers, datamodule.std).to(real.device)

    # --- the pieces: noise, the two losses ------------------------------------------------------

    def noise(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` latent vectors (n, latent_dim) and interpolation weights ε ∈ (0, 1) (n, 1) for this rank.

        One draw of one row per sample from the module's noise generator, for the whole global
        batch; this rank keeps every world_size-th row from its rank on, the way the data sampler
        shards the batch. Drawing n per rank would give every rank the same noise (the ranks'
        generators are seeded alike), and drawing z and ε in separate calls would make k
        micro-batches draw differently from one batch of k·b.
        """
        rows = self._rows(n, self.latent_dim + 1)
        return rows[:, :-1], torch.special.ndtr(rows[:, -1:])  # ndtr: Φ, so ε is uniform

    def _rows(self, n: int, width: int) -> torch.Tensor:
        """This rank's ``n`` of ``n × world_size`` rows of ``width`` standard normals from the noise generator."""
        world = self.trainer.world_size if self.attached_trainer is not None else 1
        rows = torch.randn(n * world, width, generator=self._noise_generator(), device=self.device)
        return rows[self.global_rank :: world]

    @property
    def adaptive_augmentation(self) -> bool:
        """ADA is on: an augmentation whose p moves with r_t (``ada_target`` set)."""
        return self.augment is not None and self.augment.adaptive

    def seen_by(self, critic: Any) -> Any:
        """``critic`` as D sees samples in training: through the augmentation when it is on (its random numbers,
        uniforms from the noise stream, drawn per call for the global batch and sharded like the noise)."""
        if self.augment is None:
            return critic
        return lambda x: critic(self.augment(x, torch.special.ndtr(self._rows(len(x), self.augment.draws))))

    def _noise_generator(self) -> torch.Generator:
        if self._noise is None:
            self._noise = torch.Generator(device=self.device).manual_seed(self.noise_seed)
            if self._noise_state is not None:
                self._noise.set_state(self._noise_state)
                self._noise_state = None
        return self._noise

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self._noise is not None:
            checkpoint[NOISE_KEY] = self._noise.get_state()  # a uint8 tensor: weights_only loads it
        checkpoint[D_STEPS_KEY] = self.d_steps

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._noise, self._noise_state = None, checkpoint.get(NOISE_KEY)
        self.d_steps = checkpoint.get(D_STEPS_KEY, 0)  # (older checkpoints: none taken before the lazy penalty)

    def discriminator_losses(
        self, real: torch.Tensor, fake: torch.Tensor, eps: torch.Tensor | None = None, *, with_penalty: bool = True
    ) -> dict[str, torch.Tensor]:
        """D's loss ``d`` and its terms (`multiloss.gan.objectives.discriminator_terms`); pass detached fakes. The
        penalty is a term (``gp``, ``r1`` or ``r2``, times ``penalty_weight``) when it is on, ``with_penalty`` and
        taken every step (``penalty_every`` = 1; the lazy one has its own step: `lazy_penalty_step`).

        R1 and R2 taken every step differentiate the very scores the loss is built from (stylegan2-ada's ``Dboth``
        phase, R3GAN's step): one D forward of the reals and one of the fakes, so with augmentation on the penalty
        is taken at the augmentation D's loss saw, not at another draw. (GP scores its own interpolates.)
        """
        # Through D's own DDP wrapper (when there is one): this backward's D gradients are averaged
        # across ranks, and it reaches no other parameters.
        critic = synced(self, "discriminator")
        if with_penalty:  # training: D sees augmented samples (validation scores the plain ones)
            critic = self.seen_by(critic)
        every_step = with_penalty and self.penalty != "none" and self.penalty_every == 1
        if every_step and self.penalty == "r1":
            real = real.detach().requires_grad_(True)
        if every_step and self.penalty == "r2":
            fake = fake.detach().requires_grad_(True)
        d_real = critic(real)
        if with_penalty and self.adaptive_augmentation:
            self.observe_real_scores(d_real)
        d_fake = critic(fake)
        losses = discriminator_terms(self.loss, d_real, d_fake)
        total = sum(losses.values())
        if every_step:
            if self.penalty == "gp":
                losses["gp"] = self.penalty_value(critic, real, fake, eps)
            else:
                scores, x = (d_real, real) if self.penalty == "r1" else (d_fake, fake)
                losses[self.penalty] = squared_norm_penalty(scores, x, self.scaler())
            total = total + self.penalty_weight * losses[self.penalty]
        return {**losses, "d": total}

    def observe_real_scores(self, scores: torch.Tensor) -> None:
        """ADA's r_t: these scores of (augmented) reals join the interval's sign sums, summed over the ranks (every
        rank reaches this at the same point: each D micro-batch, and each lazy R1 micro-batch)."""
        stats = self.augment.statistic(scores)
        if self.attached_trainer is not None:
            stats = self.trainer.strategy.reduce(stats, reduce_op="sum")
        self.augment.observe(stats)

    def penalty_value(
        self, critic: nn.Module, real: torch.Tensor, fake: torch.Tensor, eps: torch.Tensor | None
    ) -> torch.Tensor:
        """The penalty before its weight (`multiloss.gan.objectives.penalty`), under 16-mixed by AMP's recipe."""
        return penalty(self.penalty, critic, real, fake, eps, self.scaler())

    def scaler(self) -> Any:
        """The GradScaler under ``16-mixed`` (the penalty's input gradient is taken on scaled scores), else None."""
        return grad_scaler(self.trainer.precision_plugin) if self.attached_trainer is not None else None

    def generator_loss(self, fake: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        """G's loss through D (`multiloss.gan.objectives.generator_loss`); ``real``: the samples the relativistic loss
        pairs with ``fake``, row by row.

        D is called directly, not through its DDP wrapper: its weights are frozen for this step, so
        no D gradient may be expected (or all-reduced) by this backward.
        """
        critic = self.seen_by(self.discriminator) if self.training else self.discriminator
        d_real = critic(real) if self.loss in PAIRED else None
        return generator_loss_of(self.loss, critic(fake), d_real)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Samples for ``z``: from G_ema when ``g_ema`` is on (what validation, the sample plots, ``multiloss-eval``
        and a module from ``load_from_checkpoint`` use), else from G."""
        return self.generator_ema(z) if self.generator_ema is not None else self.generator(z)

    # --- training -------------------------------------------------------------------------------

    def training_step(self, batch: Any, batch_idx: int) -> None:
        batch, (opt_g, opt_d) = self.prepare_batch(batch), self.optimizers()
        real = batch["x"]
        g_steps = self.generator_steps_after(batch_idx)
        if g_steps and self.g_step_after == "before":  # stylegan2-ada's order: Gmain, then Dmain (and Dreg)
            self.generator_step(opt_g, real)
        z, eps = self.noise(len(real))
        # same_fakes (DCGAN): G's one forward of the batch, its graph kept for G's step below (through G's own
        # DDP wrapper, whose backward is then G's step's).
        kept = synced(self, "generator")(z) if g_steps and self.g_input == "same_fakes" else None

        # Discriminator micro-batch; D steps on every k-th batch (and an epoch's last). Inside the block only D's
        # weights require grad (toggle), DDP all-reduces only when D steps (under FSDP2 with a penalty, D is held
        # whole for the block, its gradients handed over at its end); the fakes are detached as well, so D's
        # backward stops at D's input whatever built them.
        with self.step_of(opt_d, batch_idx, components=("discriminator",), toggle=True) as d_step:
            fake = (kept if kept is not None else self.generator(z)).detach()
            d_losses = self.discriminator_losses(real, fake, eps)
            if self.loss == "bce":  # dcgan/main.py's two backward calls, real then fake (gradients summed in .grad)
                term = self.penalty_weight * d_losses[self.penalty] if self.penalty in d_losses else 0
                on_reals = self.penalty == "r1"  # R1 shares the reals' forward, whose graph the first backward frees
                d_step.backward(d_losses["d_real"] + (term if on_reals else 0), sync=False)  # the second syncs the sum
                d_step.backward(d_losses["d_fake"] + (0 if on_reals else term))
            else:
                d_step.backward(d_losses["d"])
            self.log_losses(d_losses, batch_size=len(real))  # before D's step: the non-finite guard judges it
            self._d_micro.append(_DMicroBatch(z, real, fake, eps))
            if self.generator_ema is not None:
                self.generator_ema.count(len(real) * self.trainer.world_size)
        if d_step.stepping:
            self.lazy_penalty_step(opt_d)
            self.d_steps += 1
            self.adapt_augmentation(len(real))

        # Generator step: k micro-batches through the D that D's step has just updated in place (G's loss is built
        # only now, never through a graph from before that step), on g_input's noise; only the last one syncs.
        # (A batch without G's step only advances G's epoch schedule: nothing to toggle.)
        if self.g_step_after != "before":
            self.generator_step(opt_g, real, g_steps, kept)
        if g_steps and self.generator_ema is not None:
            self.generator_ema.update(self.generator)  # after G's step and the batch's D step: the images D saw
        if d_step.stepping:
            self._d_micro = []  # the next D step's micro-batches start a new list

    def generator_step(self, opt_g: Any, real: torch.Tensor, g_steps: bool = True, kept: Any = None) -> None:
        """G's step (or, ``g_steps`` false, only its epoch schedule): k micro-batches through D as it is now."""
        with self.step_of(opt_g, stepping=g_steps, components=("generator",), toggle=g_steps) as g_step:
            g_losses = []
            for micro in g_step.micro_batches(self.accumulate_grad_batches if g_steps else 0):
                fake = kept if kept is not None else self.generator_output(micro, len(real))
                paired = (self._d_micro[micro].real if self._d_micro else real) if self.loss in PAIRED else None
                g_loss = self.generator_loss(fake, paired)
                g_step.backward(g_loss)
                g_losses.append(g_loss.detach())
            if g_losses:
                self.log_losses({"g": torch.stack(g_losses).mean()}, batch_size=len(real))

    def adapt_augmentation(self, batch_size: int) -> None:
        """ADA: after every ``ada_interval``-th D step (the interval's last: stylegan2-ada's ``batch_idx += 1`` comes
        before its ``batch_idx % ada_interval == 0``), p moves by the sign of r_t − target (the sums are every rank's
        already)."""
        if not self.adaptive_augmentation or self.d_steps % self.augment.ada_interval:
            return
        augment = self.augment
        augment.adjust(batch_size * self.trainer.world_size * self.accumulate_grad_batches * augment.ada_interval)
        self.log("augment/p", augment.p.float(), rank_zero_only=True)

    def lazy_penalty_step(self, opt_d: Any) -> None:
        """The lazy penalty (``penalty_every`` = N > 1), stylegan2-ada's ``Dreg`` phase: after every N-th D step
        (the 0th, Nth, 2Nth… from the run's start, as its ``batch_idx % reg_interval == 0``), one more D step of
        the penalty alone, times N (its ``gain``), on the D step's own micro-batches (reals, detached fakes, ε). Not
        counted in ``trainer.global_step`` and moving no schedule (`multiloss.base.step.OptimizerStep`, ``counted``)."""
        if self.penalty_every == 1 or self.d_steps % self.penalty_every:
            return
        with self.step_of(opt_d, stepping=True, components=("discriminator",), toggle=True, counted=False) as reg:
            values = []
            for micro in reg.micro_batches(len(self._d_micro)):
                kept = self._d_micro[micro]
                critic = self.seen_by(synced(self, "discriminator"))
                if self.penalty == "r1" and self.adaptive_augmentation:
                    critic = self.observing(critic)
                value = self.penalty_value(critic, kept.real, kept.fake, kept.eps)
                # Divided by the micro-batches taken (an epoch's last D step may have fewer than k).
                reg.backward(self.penalty_every * self.penalty_weight * value / len(self._d_micro), scaled=True)
                values.append(value.detach())
            self.log_losses({self.penalty: torch.stack(values).mean()}, batch_size=len(self._d_micro[0].real))

    def observing(self, critic: Any) -> Any:
        """``critic`` whose scores also feed ADA's r_t: stylegan2-ada's ``Dr1`` phase reports the signs of the reals'
        logits it differentiates (``Loss/signs/real``) as its ``Dmain`` phase does, and its heuristic averages both."""

        def scored(x: torch.Tensor) -> torch.Tensor:
            scores = critic(x)
            self.observe_real_scores(scores)
            return scores

        return scored

    def generator_steps_after(self, batch_idx: int) -> bool:
        """Whether G steps in training batch ``batch_idx``: after D's n_critic-th step of a group (``last``), after
        its first (``first``), or before the group's first D micro-batch (``before``: stylegan2-ada's Gmain before
        Dmain); D's steps counted from the epoch's start, k micro-batches each."""
        k = self.accumulate_grad_batches
        if self.g_step_after == "before":  # the batch that starts a group of n_critic D steps
            return batch_idx % (k * self.n_critic) == 0
        if (batch_idx + 1) % k:
            return False
        d_step = (batch_idx + 1) // k - 1  # the D step this batch ends, from 0
        return (d_step + 1) % self.n_critic == 0 if self.g_step_after == "last" else d_step % self.n_critic == 0

    def generator_output(self, micro: int, n: int) -> torch.Tensor:
        """G's samples for micro-batch ``micro`` of its step: on fresh noise, or (``same_z``) on D's micro-batch's."""
        if self.g_input == "same_z":
            z = self._d_micro[micro].z
        else:
            z, _ = self.noise(n)
        return synced(self, "generator")(z)

    # --- validation: losses and mode coverage on a fixed evaluation noise -----------------------

    def on_validation_epoch_start(self) -> None:
        # Its own stream, restarted every epoch: each epoch is scored on the same noise, and validation
        # never moves the global stream the training noise comes from.
        self._eval_noise = torch.Generator(device=self.device).manual_seed(self.global_rank)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        batch = self.prepare_batch(batch)
        real = batch["x"]
        z = torch.randn(len(real), self.latent_dim, generator=self._eval_noise, device=self.device)
        fake = self(z)  # G_ema's samples when it is on
        d_loss = self.discriminator_losses(real, fake, with_penalty=False)["d"]
        losses = {"d": d_loss, "g": self.generator_loss(fake, real)}
        self.epoch_means.log(self, losses, f"{self.eval_prefix}/loss/", len(real))
        if self.mode_coverage is not None:
            self.mode_coverage.update(fake)
        if self._quality is not None:
            self._quality.update(real, real=True)
            self._quality.update(fake, real=False)

    def on_validation_epoch_end(self) -> None:
        # Every rank calls compute() (it gathers the states), whatever its own number of batches.
        scores = {}
        if self.mode_coverage is not None:
            scores.update(self.mode_coverage.compute())
            self.mode_coverage.reset()
        if self._quality is not None:
            scores.update(self._quality.compute())
            self._quality.reset()
        # Equal on every rank already (compute() gathered the states): nothing to reduce (rank_zero_only makes
        # Lightning's reduction a no-op: no collective for one rank to issue alone; sync_dist keeps its warning off).
        for name, value in scores.items():
            shown = name in ("modes", "high_quality", "fid")
            self.log(f"{self.eval_prefix}/{name}", value, prog_bar=shown, sync_dist=True, rank_zero_only=True)
