"""Recipe `gan`: two networks, two optimizers, one shared tensor between them — cut it with detach().

A GAN needs two backward passes per step, the discriminator's and the generator's, and both losses are built on the
same generated samples. The classic mistake: compute ``fake = G(z)``, backward the discriminator's loss on ``fake``
itself, step D, then backward the generator's loss through the same ``fake``. The second backward raises

    RuntimeError: Trying to backward through the graph a second time (or directly access saved
    tensors after they have already been freed). ...

and, worse because silent, the first backward has already written D's loss into the generator's ``.grad`` (a push
toward fakes that are *easier* to spot). ``retain_graph=True`` silences the error and keeps the wrong gradient,
unless G's gradients happen to be zeroed in between. The cure is ``fake.detach()`` in the discriminator's loss: two
separate graphs, each backward reaching only its own network.

The second trap is the order. Build the generator's loss (a forward through D) *before* ``opt_d.step()`` and
backward it after, and autograd refuses:

    RuntimeError: one of the variables needed for gradient computation has been modified by an
    inplace operation: [torch.FloatTensor [128, 1]], which is output 0 of AsStrided, is at version 2;
    expected version 1 instead. ...

because the optimizer updated D's weights in place under a graph that had saved them. So a step here is: D's loss on
detached fakes, D's backward and step, *then* G's loss through the updated D. ``tests/recipes/test_gan.py`` shows
both failing alternatives on this module.

Each backward touches one network only: D's under ``toggle_optimizer(opt_d)`` (G's weights do not require grad, and
the fakes are detached anyway), G's under ``toggle_optimizer(opt_g)`` (the gradient flows *through* D to the fakes,
but D's weights do not require grad there and get no ``.grad``). So every backward's gradients belong to exactly one
optimizer. (Stock DDP, which wraps the whole module and waits for every parameter's gradient, still needs
``trainer.strategy=ddp_find_unused_parameters_true``; the split is what lets a leaner sync do without it.)

A gradient penalty (WGAN-GP's, R1, R2) is the other double backward here: ‖∇ₓD(x)‖ is itself a function of D's
weights, so ``torch.autograd.grad(..., create_graph=True)`` keeps the graph of that gradient to differentiate it
again; without ``create_graph`` the penalty is a constant to autograd and D's weights silently get no gradient from
it (a finite-difference check in the tests).

    python train.py recipe=gan                     # WGAN-GP on 8 Gaussians on a ring
    python train.py recipe=gan data=gaussians25    # 25 on a grid
    python train.py recipe=gan model.loss=relativistic model.penalty=r1 model.penalty_weight=0.05 model.penalty_every=16
    python train.py experiment=r3gan data.path=images.zip           # R3GAN's loop: RpGAN + R1 + R2, its schedules
    python train.py experiment=stylegan2_ada data.path=images.zip   # stylegan2-ada's: lazy R1, path length, G_ema
    python train.py --config-dir my_configs recipe=gan generator=my_gen discriminator=my_critic
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar, Literal

import lightning as L
import torch

from multiloss.base.module import Recipe
from multiloss.base.precision import grad_scaler
from multiloss.base.step import ends_optimizer_step, step_schedules
from multiloss.base.window import Window
from multiloss.building.components import build_module, build_optimizer_factory, names_given_as_objects, to_plain
from multiloss.callbacks import GeneratedSamplesPlot
from multiloss.config import require
from multiloss.data.batches import require_keys
from multiloss.gan.augment import build_augment
from multiloss.gan.checks import check_networks
from multiloss.gan.ema import GeneratorEMA
from multiloss.gan.metrics import ValidationScores
from multiloss.gan.metrics import check_options as check_quality_options
from multiloss.gan.noise import NoiseStream
from multiloss.gan.objectives import GANLoss, correct_betas, discriminator_loss, lazy_ratio, penalty
from multiloss.gan.options import build_loss, build_path_length, check_options, penalty_of
from multiloss.gan.phases import DMicroBatch, generator_steps_after
from multiloss.gan.schedules import beta2_schedule, build_schedules, check_schedules
from multiloss.parallel.ddp import synced
from multiloss.saving.saved_state import (
    D_STEPS_KEY,
    G_STEPS_KEY,
    IMAGES_KEY,
    NOISE_DRAW_KEY,
    NOISE_KEY,
    SCHEDULED_AT_KEY,
)


class GAN(Recipe):
    """GAN: a generator and a discriminator, two optimizers, detached fakes, n_critic D steps per G step.

    Components (docs/your-model.md): ``generator(z)``, ``z`` of shape ``(batch, latent_dim)``, returns samples of the
    data's sample shape; ``discriminator(x)`` one score a sample (a logit; a probability with ``loss=bce``), no
    BatchNorm with a penalty; ``g_optimizer``, ``d_optimizer`` (``adam_gan``), one schedule each (``linear_decay``);
    batches with ``x``. ``data_dim`` feeds the shipped ``mlp`` options only.

    The step reads top to bottom in ``training_step``: this batch's scheduled values (over the images seen); D's
    micro-batch on detached fakes (only D's weights requiring grad), D's step every k-th batch (and, lazily, its
    penalties' own step); then, when `multiloss.gan.phases.generator_steps_after` says, G's k
    micro-batches through the D just updated (``g_step_after``: the paper's order, PyTorch-GAN's, stylegan2-ada's),
    on ``g_input`` (fresh noise, D's noise, or D's very fakes), and every ``g_reg_every``-th G step path length's own
    G step. ``trainer.max_steps`` counts both optimizers' steps (not the lazy ones).

    Where the parts live (`multiloss.gan`): the losses (``loss``) and penalties (``penalty``, one or several — R3GAN's
    ``[r1, r2]`` —, ``penalty_weight``, ``penalty_every``: every D step, or stylegan2-ada's lazy regularization with
    D's Adam corrected) in `multiloss.gan.objectives`; G's lazy regularization (``g_reg_every``: G's Adam corrected;
    ``path_length``) in `multiloss.gan.path_length`; the values over the images seen (``schedules``: γ, β2, the EMA
    half-life, the augmentation's p; the rate: ``scheduler=images``) in `multiloss.gan.schedules`; the shipped conv
    nets in `multiloss.gan.nets`; what D sees (``augment``: DiffAugment, ADA) in `multiloss.gan.augment`; the moving
    average of G (``g_ema``: validation, samples, ``multiloss-eval`` and ``forward`` sample from it) in
    `multiloss.gan.ema`; the training noise (its own generator seeded with ``noise_seed``, drawn for the global
    batch, checkpointed) in `multiloss.gan.noise`; the quality metrics (``metrics``) in `multiloss.gan.metrics`.

    Logs ``loss/d`` (its terms ``loss/d_real``, ``loss/d_fake`` or ``loss/d_pair``, each ``loss/<penalty>``),
    ``loss/g`` on G's steps, ``loss/path_length`` on path length's; ``val/loss/d``, ``val/loss/g``, ``val/modes``
    and ``val/high_quality`` on Gaussian mixtures, the quality metrics with ``metrics``; ``samples/epoch_<n>.png``
    at every epoch end.

    Raises:
        ConfigError: an option out of its range or a combination no loop runs (`multiloss.gan.options`), the step
            options' checks (`multiloss.base.module.Recipe`); at setup, before any step or write, networks that do
            not fit the data or the loss (`multiloss.gan.checks`). A single ``model.optimizer`` is an unknown key: the
            GAN has two.
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
        loss: str | dict[str, Any] | GANLoss = "nonsaturating",  # a shipped spelling, or {_target_: <your GANLoss>}
        n_critic: int = 1,
        penalty: str | dict[str, Any] | list[Any] = "none",  # spellings, {_target_: <your GradientPenalty>}
        penalty_weight: float | list[float] = 0.0,
        penalty_every: int = 1,
        g_reg_every: int = 1,
        path_length: dict[str, Any] | None = None,
        schedules: dict[str, Any] | None = None,
        latent_dim: int = 2,
        data_dim: int = 2,
        n_plot_samples: int = 1000,
        noise_seed: int = 0,
        g_input: Literal["fresh", "same_fakes", "same_z"] = "fresh",
        g_step_after: Literal["last", "first", "before"] = "last",
        g_reals: Literal["d_batch", "own_batch"] = "d_batch",
        g_ema: dict[str, Any] | None = None,
        augment: dict[str, Any] | None = None,
        metrics: dict[str, Any] | None = None,
        gp_weight: float | None = None,  # before penalty/penalty_weight: read from older checkpoints' hyperparameters
        **step_options: Any,  # the options of every recipe's step (multiloss.base.module.Recipe)
    ) -> None:
        super().__init__(**step_options)
        objective = build_loss(to_plain(loss))
        penalties, penalty_terms = penalty_of(to_plain(penalty), to_plain(penalty_weight), gp_weight)
        check_options(
            loss=objective,
            n_critic=n_critic,
            penalties=penalties,
            penalty_every=penalty_every,
            g_reg_every=g_reg_every,
            latent_dim=latent_dim,
            data_dim=data_dim,
            n_plot_samples=n_plot_samples,
            g_input=g_input,
            g_step_after=g_step_after,
            g_reals=g_reals,
            accumulate_grad_batches=self.accumulate_grad_batches,
        )
        generator, discriminator = to_plain(generator), to_plain(discriminator)
        g_optimizer, d_optimizer = to_plain(g_optimizer), to_plain(d_optimizer)
        given = names_given_as_objects(
            generator=generator,
            discriminator=discriminator,
            g_optimizer=g_optimizer,
            d_optimizer=d_optimizer,
            loss=loss if isinstance(loss, GANLoss) else None,
        )
        self.save_hyperparameters(ignore=given, logger=False)
        self.g_optimizer_factory = build_optimizer_factory(g_optimizer, "g_optimizer")
        self.d_optimizer_factory = build_optimizer_factory(d_optimizer, "d_optimizer")
        self.loss, self.n_critic = objective, n_critic  # a GANLoss (multiloss.gan.objectives)
        self.penalties, self.penalty_every = penalties, penalty_every  # name -> weight, in the order given
        self.penalty_terms = penalty_terms  # name -> its GradientPenalty
        self.g_reg_every = g_reg_every
        self.latent_dim, self.n_plot_samples, self.noise_seed = latent_dim, n_plot_samples, noise_seed
        self.g_input, self.g_step_after, self.g_reals = g_input, g_step_after, g_reals
        self._d_micro: list[DMicroBatch] = []  # the D step's micro-batches so far (same_z, relativistic, lazy)
        self.d_steps = 0  # D's (counted) steps so far, checkpointed: the lazy penalty's phase
        self.g_steps = 0  # G's steps so far, checkpointed: the lazy path length's phase
        self.images_seen = 0  # real images D has trained on (all ranks), checkpointed
        # The schedules' clock: images_seen at the start of the iteration (a batch, or own_batch's D-and-G pair).
        self.scheduled_at = 0
        self.noise_stream = NoiseStream(noise_seed)  # the training noise (multiloss.gan.noise)

        self.generator = build_module(generator, "generator")
        self.discriminator = build_module(discriminator, "discriminator")
        # The average sits beside G: sharded like it under FSDP2 (a component of its own), never wrapped by DDP (it
        # is not trained; the ranks' copies stay equal because their G's do).
        self.generator_ema = GeneratorEMA.from_options(self.generator, to_plain(g_ema))
        if self.generator_ema is not None:
            self.components = (*self.components, "generator_ema")
        self.augment = build_augment(to_plain(augment))  # what D sees in training (multiloss.gan.augment)
        # G's lazy regularization (multiloss.gan.path_length): its options and running mean, in every checkpoint.
        self.path_length = build_path_length(to_plain(path_length), g_reg_every)
        self.schedules = build_schedules(to_plain(schedules))  # over images seen (multiloss.gan.schedules)
        check_schedules(self.schedules, penalties=bool(penalties), ema=self.generator_ema, augment=self.augment)
        self.metrics_spec = to_plain(metrics)
        check_quality_options(self.metrics_spec)
        self.scores = ValidationScores(self.metrics_spec, noise_seed)  # beyond the losses (built at setup)
        self.sample_shape: tuple[int, ...] | None = None  # a data sample's shape, seen by the component check
        self._eval_noise: torch.Generator | None = None  # set at every validation epoch's start

    def held_whole(self, trainer: L.Trainer) -> tuple[str, ...]:
        # A penalty differentiates ∇D(x) again (create_graph): a double backward through the critic; path length
        # one through the generator.
        return (*(("discriminator",) if self.penalties else ()), *(("generator",) if self.path_length else ()))

    def not_compilable(self, name: str) -> str:
        if name == "discriminator" and self.penalties:
            return "the gradient penalty differentiates its gradient, a double backward torch.compile does not support"
        if name == "generator" and self.path_length is not None:
            return "path length differentiates its gradient, a double backward torch.compile does not support"
        return ""

    def scheduled_settings(self, index: int) -> tuple[str, ...]:
        """The optimizer settings ``apply_schedules`` sets every batch (optimizer ``index``: 0 G's, 1 D's): a resume
        keeps the checkpoint's instead of reporting the config's as a change."""
        return ("betas",) if beta2_schedule(self.schedules, ("generator", "discriminator")[index]) else ()

    @property
    def images_seen_clock(self) -> Any:
        """The clock of the schedules over images (``scheduler=images``): the images D had trained on when this
        iteration started (``scheduled_at``)."""
        return lambda: self.scheduled_at

    def lr_rule(self, optimizer: Any) -> tuple[float, dict[str, Any]]:
        # A lazy regularization's extra step: stylegan2-ada's lr × N/(N+1) (its betas: configure_optimizers).
        key, every = self.lazy_interval(optimizer.param_groups[0].get("name"))
        return (lazy_ratio(every), {key: every}) if every > 1 else (1.0, {})

    def lazy_interval(self, network: str | None) -> tuple[str, int]:
        """The key and interval N of ``network``'s lazy regularization: its Adam runs at lr·N/(N+1), betas^(N/(N+1))
        (stylegan2-ada corrects G's at ``G_reg_interval=4`` even with no path length: training_loop.py 106, 201-205)."""
        return (
            ("model.g_reg_every", self.g_reg_every)
            if network == "generator"
            else ("model.penalty_every", self.penalty_every)
        )

    def configure_optimizers(self) -> list[Any]:
        # Named param groups: LearningRateMonitor logs `lr-<Optimizer>/generator` and `.../discriminator`.
        opt_g = self.optimizer_of(self.g_optimizer_factory, [self.param_group_of("generator")], "model.g_optimizer")
        opt_d = self.optimizer_of(self.d_optimizer_factory, [self.param_group_of("discriminator")], "model.d_optimizer")
        for optimizer, every in ((opt_g, self.g_reg_every), (opt_d, self.penalty_every)):
            if every > 1:
                correct_betas(optimizer, lazy_ratio(every))
        for optimizer, network, key in (
            (opt_g, "generator", "model.g_optimizer"),
            (opt_d, "discriminator", "model.d_optimizer"),
        ):
            scheduled = beta2_schedule(self.schedules, network)
            require(
                scheduled is None or all("betas" in group for group in optimizer.param_groups),
                f"model.schedules.{scheduled[0] if scheduled else None}",
                "set",
                f"null, or an optimizer with betas (Adam, AdamW) as {key}",
                f"{key} has no betas",
            )
        return [self.with_schedule(opt_g, "model.g_optimizer"), self.with_schedule(opt_d, "model.d_optimizer")]

    def param_group_of(self, name: str) -> dict[str, Any]:
        return {"params": getattr(self, name).parameters(), "name": name}

    def output_callbacks(self) -> list[L.Callback]:
        return [GeneratedSamplesPlot(self.n_plot_samples)] if self.n_plot_samples else []

    def check_components(self, batch: dict[str, Any]) -> None:
        require_keys(batch, ("x",), "the real samples")
        real = batch["x"]
        names = (self.component_name("generator"), self.component_name("discriminator"))
        check_networks(self.generator, self.discriminator, names, real, self.latent_dim, self.loss, self.penalties)
        self.sample_shape = tuple(real.shape[1:])
        if self.augment is not None:
            self.augment.set_sample_shape(self.sample_shape)
        self.scores.build(self.sample_shape, self.attached_datamodule, real.device)

    # --- the pieces: noise, the two losses ------------------------------------------------------

    def noise(self, n: int, everyone: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` latent vectors (n, latent_dim) and interpolation weights ε ∈ (0, 1) (n, 1) for this rank, of one draw
        of a row per sample of every rank (``everyone``; n × world size when not given: `multiloss.gan.noise`), so
        k micro-batches draw what one batch of their examples draws, and W ranks what one rank of W·b does."""
        rows = self._rows(n, self.latent_dim + 1, everyone)
        return rows[:, :-1], torch.special.ndtr(rows[:, -1:])  # ndtr: Φ, so ε is uniform

    def _rows(self, n: int, width: int, everyone: int | None = None) -> torch.Tensor:
        """This rank's ``n`` of ``everyone`` (n × world size) rows of ``width`` standard normals from the noise
        stream."""
        world = self.trainer.world_size if self.attached_trainer is not None else 1
        return self.noise_stream.rows(n, width, self.device, self.global_rank, world, everyone)

    @property
    def adaptive_augmentation(self) -> bool:
        """ADA is on: an augmentation whose p moves with r_t (``ada_target`` set)."""
        return self.augment is not None and self.augment.adaptive

    def seen_by(self, critic: Any) -> Any:
        """``critic`` as D sees samples in training: through the augmentation when it is on."""
        if self.augment is None:
            return critic
        return self.augment.seen_by(critic, lambda n, width: torch.special.ndtr(self._rows(n, width)))

    def _sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        return self.trainer.strategy.reduce(value, reduce_op="sum") if self.attached_trainer is not None else value

    def _noise_generator(self) -> torch.Generator:
        return self.noise_stream.generator(self.device)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        if (state := self.noise_stream.state()) is not None:
            checkpoint[NOISE_KEY] = state
        checkpoint[NOISE_DRAW_KEY] = self.noise_stream.draw
        checkpoint[D_STEPS_KEY] = self.d_steps
        checkpoint[G_STEPS_KEY] = self.g_steps
        checkpoint[IMAGES_KEY] = self.images_seen
        checkpoint[SCHEDULED_AT_KEY] = self.scheduled_at

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        # An earlier version's checkpoint (no draw named) goes on drawing its normals as it did: randn.
        self.noise_stream.load(checkpoint.get(NOISE_KEY), checkpoint.get(NOISE_DRAW_KEY, "randn"))
        self.d_steps = checkpoint.get(D_STEPS_KEY, 0)  # (older checkpoints: none taken before the lazy penalty)
        self.g_steps = checkpoint.get(G_STEPS_KEY, 0)
        self.images_seen = checkpoint.get(IMAGES_KEY, 0)
        self.scheduled_at = checkpoint.get(SCHEDULED_AT_KEY, self.images_seen)

    def discriminator_losses(
        self,
        real: torch.Tensor,
        fake: torch.Tensor,
        eps: torch.Tensor | None = None,
        *,
        with_penalty: bool = True,
        side: str | None = None,
    ) -> dict[str, torch.Tensor]:
        """D's loss ``d`` and its terms on detached fakes (`multiloss.gan.objectives.discriminator_loss`), the penalty
        taken every step when ``with_penalty`` (the lazy one has its own step)."""
        # Through D's own DDP wrapper (when there is one): this backward's D gradients are averaged across ranks, and it
        # reaches no other parameters. In training D sees augmented samples (validation scores the plain ones).
        critic = self.seen_by(synced(self, "discriminator")) if with_penalty else synced(self, "discriminator")
        taken = self.penalties if with_penalty and self.penalty_every == 1 else {}
        observing = with_penalty and self.adaptive_augmentation  # ADA's r_t counts D's scores of the reals
        observe = (lambda scores: self.augment.observe_scores(scores, self._sum_over_ranks)) if observing else None
        return discriminator_loss(
            self.loss, critic, real, fake, eps, taken, self.penalty_terms, self.scaler(), observe, side
        )

    def scaler(self) -> Any:
        """The GradScaler under ``16-mixed`` (the penalty's input gradient is taken on scaled scores), else None."""
        return grad_scaler(self.trainer.precision_plugin) if self.attached_trainer is not None else None

    def generator_loss(self, fake: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        """G's loss through D (``real``: what the relativistic loss pairs with ``fake``), D called directly, not through
        its DDP wrapper: its weights are frozen for this step, no D gradient is expected (or all-reduced)."""
        critic = self.seen_by(self.discriminator) if self.training else self.discriminator
        d_real = critic(real) if self.loss.paired else None
        return self.loss.generator_loss(critic(fake), d_real)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Samples for ``z``: from G_ema when ``g_ema`` is on (what validation, the sample plots, ``multiloss-eval``
        and a module from ``load_from_checkpoint`` use), else from G."""
        return self.generator_ema(z) if self.generator_ema is not None else self.generator(z)

    # --- training -------------------------------------------------------------------------------

    def training_step(self, batch: Any, batch_idx: int) -> None:
        batch, (opt_g, opt_d) = self.prepare_batch(batch), self.optimizers()
        real = batch["x"]
        # g_reals=own_batch (R3GAN's loop): D's and G's batches alternate (across epochs too), G pairing its fakes with
        # its own reals.
        d_turn = self.g_reals == "d_batch" or self.d_steps == self.g_steps
        if d_turn:  # (G's own batch trains at its iteration's values: the clock moves at D's turn only)
            self.scheduled_at = self.images_seen
        self.apply_schedules(opt_g, opt_d)  # this batch's rate, β2, γ, half-life, p from the images seen before it
        g_steps = self.generator_steps_after(batch_idx)
        if g_steps and self.g_step_after == "before":  # stylegan2-ada's order: Gmain, then Dmain (and Dreg)
            self.generator_step(opt_g, batch_idx, real)
        if d_turn:
            d_stepped, kept = self.discriminator_step(opt_d, batch_idx, real, g_steps)
        else:  # G's own batch: no D step, only D's epoch schedule at an epoch's end
            d_stepped, kept = False, None
            step_schedules(self.trainer, opt_d, stepped=False)

        # Generator step: k micro-batches through the D that D's step has just updated in place (G's loss is built
        # only now, never through a graph from before that step), on g_input's noise; only the last one syncs.
        # (A batch without G's step only advances G's epoch schedule: nothing to toggle.)
        if self.g_step_after != "before":
            self.generator_step(opt_g, batch_idx, real, g_steps, kept)
        if g_steps and self.generator_ema is not None:
            self.generator_ema.update(self.generator)  # after G's step and the batch's D step: the images D saw
        if d_stepped:
            self._d_micro = []  # the next D step's micro-batches start a new list

    def discriminator_step(
        self, opt_d: Any, batch_idx: int, real: torch.Tensor, g_steps: bool
    ) -> tuple[bool, torch.Tensor | None]:
        """D's micro-batch on this batch's reals and fresh fakes, D's step on every k-th batch (and an epoch's last),
        then its lazy penalties' step and ADA's move; whether D stepped, and (same_fakes) the fakes with G's graph."""
        # This micro-batch's examples here and on every rank (the loader's, `multiloss.base.window`): the noise is one
        # draw of every rank's rows, the images seen count every rank's.
        examples = self.step_examples(batch_idx, len(real))[batch_idx % self.accumulate_grad_batches]
        z, eps = self.noise(len(real), examples[1])
        # same_fakes (DCGAN): G's one forward of the batch, its graph kept for G's step (through G's own DDP wrapper,
        # whose backward is then G's step's).
        kept = synced(self, "generator")(z) if g_steps and self.g_input == "same_fakes" else None

        # Inside the block only D's weights require grad (toggle), DDP all-reduces only when D steps (under FSDP2 with
        # a penalty, D is held whole for the block, its gradients handed over at its end); the fakes are detached as
        # well, so D's backward stops at D's input whatever built them.
        with self.step_of(opt_d, batch_idx, components=("discriminator",), toggle=True) as d_step:
            fake = (kept if kept is not None else self.generator(z)).detach()
            if self.loss.probabilities:  # dcgan/main.py's order: D on the reals and its backward, then on the fakes
                # The first pair unsynced, its forward too (DDP decides a backward's sync at its forward); the second
                # syncs the sum of both in .grad. R1 goes with the reals, GP and R2 with the fakes.
                with self.parallelism.no_sync():
                    real_losses = self.discriminator_losses(real, fake, eps, side="real")
                    d_step.backward(real_losses["d"], sync=False)
                fake_losses = self.discriminator_losses(real, fake, eps, side="fake")
                d_step.backward(fake_losses["d"])
                d_losses = {**real_losses, **fake_losses, "d": real_losses["d"].detach() + fake_losses["d"].detach()}
            else:
                d_losses = self.discriminator_losses(real, fake, eps)
                d_step.backward(d_losses["d"])
            self.log_losses(d_losses, batch_size=len(real))  # before D's step: the non-finite guard judges it
            self._d_micro.append(DMicroBatch(z, real, fake, eps, examples))
            self.images_seen += examples[1]
            if self.generator_ema is not None:
                self.generator_ema.count(examples[1])
        if d_step.stepping:
            self.lazy_penalty_step(opt_d)
            self.d_steps += 1
            images = sum(micro.examples[1] for micro in self._d_micro)
            if self.adaptive_augmentation and self.augment.adapt_after(self.d_steps, images):  # ADA's p moved
                self.log("augment/p", self.augment.p.float(), rank_zero_only=True)
        return d_step.stepping, kept

    def generator_step(
        self, opt_g: Any, batch_idx: int, real: torch.Tensor, g_steps: bool = True, kept: Any = None
    ) -> None:
        """G's step (or, ``g_steps`` false, only its epoch schedule) through D as it is now: a micro-batch for each of
        the D step's (k, fewer in an epoch's short last one), each of its examples, weighed as D's
        (``model.accumulation_mean``)."""
        micro_batches = self.step_examples(batch_idx, len(real)) if g_steps else []
        with self.step_of(opt_g, batch_idx, stepping=g_steps, components=("generator",), toggle=g_steps) as g_step:
            g_losses = []
            for micro in g_step.micro_batches(len(micro_batches)):
                mine, everyone = micro_batches[micro]
                fake = kept if kept is not None else self.generator_output(micro, max(mine, 1), everyone)
                paired = (self._d_micro[micro].real if self._d_micro else real) if self.loss.paired else None
                g_loss = self.generator_loss(fake, paired)
                g_step.backward(g_loss, micro=micro)
                g_losses.append(g_loss.detach())
            if g_losses:
                self.log_losses({"g": torch.stack(g_losses).mean()}, batch_size=len(real))
        if g_steps:
            self.lazy_path_length_step(opt_g, micro_batches)
            self.g_steps += 1

    def lazy_path_length_step(self, opt_g: Any, micro_batches: list[tuple[int, int]]) -> None:
        """stylegan2-ada's ``Greg`` (``model.path_length``): after every ``g_reg_every``-th G step (from the first),
        one more G step of the path-length penalty alone, times ``g_reg_every``, on fresh latents (a micro-batch for
        each of G's step's, of its examples a rank // ``batch_shrink``, alike on every rank); not counted in
        ``trainer.global_step``, moving no schedule."""
        if self.path_length is None or self.g_steps % self.g_reg_every:
            return
        world = self.trainer.world_size
        with self.step_of(opt_g, stepping=True, components=("generator",), toggle=True, counted=False) as reg:
            values = []
            k = len(micro_batches)
            n = -(-micro_batches[0][1] // world)  # (for the log's batch size)
            for micro in reg.micro_batches(k):
                z, _ = self.noise(max(1, -(-micro_batches[micro][1] // world) // self.path_length.batch_shrink))
                loss, value = self.path_length.loss(
                    self.generator, synced(self, "generator"), z, self._rows, self._sum_over_ranks
                )
                reg.backward(self.g_reg_every * loss / k, scaled=True)
                values.append(value)
            self.log_losses({"path_length": torch.stack(values).mean()}, batch_size=n)

    def apply_schedules(self, opt_g: Any, opt_d: Any) -> None:
        """R3GAN's per-iteration values from the images seen so far (`multiloss.gan.schedules`): the rate of an
        ``images`` schedule (``scheduler=images``: stepped here, the rate's one owner), then ``model.schedules``' γ,
        β2, G_ema half-life and augmentation p."""
        if self.attached_trainer is not None:
            for config in self.trainer.lr_scheduler_configs:
                if getattr(config.scheduler, "interval", None) == "images":
                    with warnings.catch_warnings():  # torch's "step() before optimizer.step()": the rate of this
                        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler")  # batch, by design
                        config.scheduler.step()
        if not self.schedules:
            return
        images, curves = self.scheduled_at, self.schedules
        if "gamma" in curves:
            gamma = curves["gamma"](images)
            self.penalties = dict.fromkeys(self.penalties, gamma)
        for optimizer, network in ((opt_g, "generator"), (opt_d, "discriminator")):
            if (scheduled := beta2_schedule(curves, network)) is not None:
                beta2 = scheduled[1](images)
                _, every = self.lazy_interval(network)
                for group in getattr(optimizer, "optimizer", optimizer).param_groups:
                    group["betas"] = (group["betas"][0], beta2 ** lazy_ratio(every) if every > 1 else beta2)
        if "ema_half_life" in curves:
            self.generator_ema.half_life_images = curves["ema_half_life"](images)
        if "augment_p" in curves:
            self.augment.p.fill_(curves["augment_p"](images))

    def lazy_penalty_step(self, opt_d: Any) -> None:
        """stylegan2-ada's ``Dreg`` (``penalty_every`` = N > 1): after every N-th D step, one more D step of the
        penalties alone, times N, on that step's micro-batches; not counted in ``trainer.global_step``, moving no
        schedule."""
        if self.penalty_every == 1 or self.d_steps % self.penalty_every:
            return
        with self.step_of(opt_d, stepping=True, components=("discriminator",), toggle=True, counted=False) as reg:
            values: dict[str, list[torch.Tensor]] = {name: [] for name in self.penalties}
            weights = self.lazy_penalty_weights()
            for micro in reg.micro_batches(len(self._d_micro)):
                kept = self._d_micro[micro]
                total = 0
                for name, weight in self.penalties.items():
                    critic = self.seen_by(synced(self, "discriminator"))
                    term = self.penalty_terms[name]
                    if term.at == "real" and self.adaptive_augmentation:
                        critic = self.augment.observing(critic, self._sum_over_ranks)
                    value = penalty(term, critic, kept.real, kept.fake, kept.eps, self.scaler())
                    total = total + weight * value
                    values[name].append(value.detach())
                reg.backward(self.penalty_every * total * weights[micro], scaled=True)
            means = {name: torch.stack(taken).mean() for name, taken in values.items()}
            self.log_losses(means, batch_size=len(self._d_micro[0].real))

    def lazy_penalty_weights(self) -> list[float]:
        """What multiplies each of the D step's micro-batches' penalties in the lazy step: its weight in D's step
        (``model.accumulation_mean``: its examples' share, or 1/k), 1 / the micro-batches taken where the loader does
        not say its examples."""
        k, taken = self.accumulate_grad_batches, self._d_micro
        if self.accumulation_mean != "examples" or self.example_counts() is None:
            return [1 / len(taken)] * len(taken)
        window = Window(tuple(micro.examples for micro in taken), self.trainer.world_size, k)
        return [1 / k if (w := window.weight(i)) is None else w for i in range(len(taken))]

    def generator_steps_after(self, batch_idx: int) -> bool:
        """Whether G steps in training batch ``batch_idx`` (`multiloss.gan.phases.generator_steps_after`)."""
        if self.g_reals == "own_batch":  # R3GAN's: D on one batch, G on the next with its reals
            return self.d_steps > self.g_steps
        ends_d_step = ends_optimizer_step(self, batch_idx)
        return generator_steps_after(
            batch_idx, self.accumulate_grad_batches, self.n_critic, self.g_step_after, ends_d_step
        )

    def generator_output(self, micro: int, n: int, everyone: int | None = None) -> torch.Tensor:
        """G's samples for micro-batch ``micro`` of its step: on fresh noise (``n`` here of ``everyone`` rows on every
        rank), or (``same_z``) on D's micro-batch's."""
        if self.g_input == "same_z":
            z = self._d_micro[micro].z
        else:
            z, _ = self.noise(n, everyone)
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
        self.scores.update(real, fake)

    def on_validation_epoch_end(self) -> None:
        self.scores.log(self, self.eval_prefix)  # every rank: the metrics gather their states
