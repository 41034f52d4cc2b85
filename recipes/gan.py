"""Recipe `gan`: two networks, two optimizers, one shared tensor between them — cut it with detach().

A GAN needs two backward passes per step, the discriminator's and the generator's, and both losses
are built on the same generated samples. The field notes' version of the mistake: compute
``fake = G(z)``, backward the discriminator's loss on ``fake`` itself, step D, then backward the
generator's loss through the same ``fake``. The second backward raises

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

WGAN-GP's gradient penalty is the other double-backward of the seeds: ‖∇ₓD(x̂)‖ is itself a
function of D's weights, so ``torch.autograd.grad(..., create_graph=True)`` keeps the graph of that
gradient to differentiate it again; without ``create_graph`` the penalty is a constant to autograd
and D's weights silently get no gradient from it (a finite-difference check in the tests).

    python train.py recipe=gan                     # WGAN-GP on 8 Gaussians on a ring
    python train.py recipe=gan data=gaussians25    # 25 on a grid
    python train.py recipe=gan model.loss=nonsaturating model.gp_weight=0 model.n_critic=1
    python train.py recipe=gan data=digits model.data_dim=64 model.latent_dim=16
    python train.py --config-dir my_configs recipe=gan generator=my_gen discriminator=my_critic
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any, ClassVar, Literal

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from multiloss.accumulation import ManualAccumulation
from multiloss.batches import require_keys
from multiloss.components import build_module, build_optimizer_factory, objects_given, plain
from multiloss.config import ConfigError, require
from multiloss.distributed import synced
from multiloss.metrics import ModeCoverage
from multiloss.module import Recipe, call_component, describe_output


def gradient_penalty(critic: nn.Module, real: torch.Tensor, fake: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """E[(‖∇ₓ̂ critic(x̂)‖₂ − 1)²] at x̂ = ε·real + (1−ε)·fake (Gulrajani et al., 2017).

    ``create_graph=True``: the penalty is a function of a gradient, and its own gradient w.r.t. the
    critic's weights needs the graph of that gradient (a double backward).
    """
    eps = eps.view(-1, *[1] * (real.dim() - 1))  # one ε per sample, whatever the sample's shape
    x_hat = (eps * real + (1 - eps) * fake).requires_grad_(True)
    # Summing is exact when each score depends on its own sample only (no BatchNorm in the critic).
    (grad,) = torch.autograd.grad(critic(x_hat).sum(), x_hat, create_graph=True)
    return ((grad.flatten(1).norm(2, dim=1) - 1) ** 2).mean()


def _linear_decay(epoch: int, epochs: int) -> float:
    return max(0.0, 1 - epoch / epochs)


class GAN(Recipe):
    """GAN: a generator and a discriminator, two optimizers, detached fakes, n_critic D steps per G step.

    Components:
        generator (group ``generator``, default ``mlp``: `multiloss.nets.MLP` from ``latent_dim`` to
            ``data_dim`` features): ``generator(z)`` with ``z`` of shape ``(batch, latent_dim)``
            returns samples of the data's sample shape (checked at setup).
        discriminator (group ``discriminator``, default ``mlp``): ``discriminator(x)`` returns one
            score (a logit) per sample, shape ``(batch,)`` or ``(batch, 1)``. No BatchNorm: the
            gradient penalty is per sample, and split batches must give the same gradients.
        g_optimizer, d_optimizer (options of the ``optimizer`` group, default ``adam_gan``).
        data: batches with ``x`` (real samples, any shape); ``(x,)`` / ``(x, y)`` tuples too.

    ``latent_dim`` is the noise's width; ``data_dim`` is read by the shipped ``mlp`` options only
    (``${model.data_dim}`` in their configs): the recipe itself takes the sample shape from the data.

    Manual optimization with two optimizers, ``model.g_optimizer`` and ``model.d_optimizer`` (each
    picked from the ``optimizer`` group: ``optimizer@model.d_optimizer=sgd``). Per training batch:
    one discriminator (critic) micro-batch on the real batch and as many generated points,
    detached, with only D's weights requiring grad; every ``n_critic``·``accumulate_grad_batches``-th
    batch, right after D has stepped, one generator step of ``accumulate_grad_batches``
    micro-batches of fresh noise through the updated D, with only G's weights requiring grad.

    Losses: ``nonsaturating`` (D: softplus(−D(x)) + softplus(D(G(z))); G: softplus(−D(G(z)))) or
    ``wgan-gp`` (critic: D(G(z)) − D(x) + λ·GP; G: −D(G(z))). ``gp_weight`` = λ > 0 adds the gradient
    penalty E[(‖∇D(x̂)‖ − 1)²] on random interpolates x̂ (with either loss; 0 = off).
    ``lr_schedule=linear`` (default) lowers both learning rates linearly to 0 by
    ``trainer.max_epochs``, one step per epoch; ``constant`` keeps them.

    ``accumulate_grad_batches`` = k > 1 accumulates each network's steps over k micro-batches
    (`multiloss.accumulation.ManualAccumulation`; Lightning's own ``trainer.accumulate_grad_batches``
    refuses manual optimization). The training noise comes from the module's own generator, seeded
    with ``noise_seed`` (``${seed}`` in the config) and saved in every checkpoint, drawn for the whole
    global batch and sharded like the data: so k micro-batches of b draw what one batch of k·b
    draws, and so do 2 ranks × b and 1 rank × 2b (on CPU, for b a multiple of 16), and a resumed
    run draws what the uninterrupted one did. Not torch's global stream: Lightning's DDP re-seeds
    that at setup (``reset_seed``) while a one-device run keeps what model initialisation left of
    it, so the two would draw different noise from the same seed.

    Logs per step ``loss/d`` (= ``loss/d_real`` + ``loss/d_fake`` + λ·``loss/gp``) and, on generator
    steps, ``loss/g``; per epoch ``val/loss/d``, ``val/loss/g`` and, on Gaussian-mixture data,
    ``val/modes`` (modes hit) and ``val/high_quality`` (share of samples within 3σ of a mode) from
    a fixed evaluation noise. Writes ``samples/epoch_<n>.png`` into the run dir at every epoch end:
    real vs generated points for 2-D samples, or a grid of generated images for image-shaped samples
    (``(H, W)``, ``(1 or 3, H, W)``, or a square number of features such as the digits' 64).

    Raises:
        ConfigError: ``n_critic``, ``accumulate_grad_batches``, ``latent_dim`` or ``data_dim`` < 1;
            ``gp_weight`` < 0, or 0 with ``loss=wgan-gp``;
            ``n_plot_samples`` < 0; ``trainer.accumulate_grad_batches`` ≠ 1 (use
            ``model.accumulate_grad_batches``) or ``trainer.gradient_clip_val`` set (Lightning cannot
            honour either under manual optimization); at setup (before any step or write), a
            generator whose samples do not have the data's shape (with the shipped ``mlp``: set
            ``model.data_dim`` to the data's feature count) or a discriminator that does not give
            one score per sample. A single ``model.optimizer`` (``optimizer=sgd``) is an unknown key: the
            GAN has two.
    """

    # Under multiloss's DDP each network gets its own wrapper, so a backward that reaches only one of
    # them (every backward here) finds exactly the parameters DDP waits for: no
    # find_unused_parameters=True graph walk (src/multiloss/distributed.py).
    ddp_submodules = ("generator", "discriminator")

    def __init__(
        self,
        generator: Any,
        discriminator: Any,
        g_optimizer: Any = None,
        d_optimizer: Any = None,
        loss: Literal["nonsaturating", "wgan-gp"] = "nonsaturating",
        n_critic: int = 1,
        gp_weight: float = 0.0,
        accumulate_grad_batches: int = 1,
        latent_dim: int = 2,
        data_dim: int = 2,
        lr_schedule: Literal["linear", "constant"] = "linear",
        n_plot_samples: int = 1000,
        noise_seed: int = 0,
        compile: bool = False,
    ) -> None:
        super().__init__(compile=compile)
        for key, value in (("n_critic", n_critic), ("latent_dim", latent_dim), ("data_dim", data_dim)):
            require(value >= 1, key, value, "an integer ≥ 1")
        require(gp_weight >= 0, "gp_weight", gp_weight, "a number ≥ 0 (0 = no gradient penalty)")
        require(
            loss != "wgan-gp" or gp_weight > 0,
            "gp_weight",
            gp_weight,
            "a positive number with loss=wgan-gp (e.g. 0.1; the Wasserstein critic needs the penalty to stay "
            "Lipschitz), or loss=nonsaturating",
        )
        require(n_plot_samples >= 0, "n_plot_samples", n_plot_samples, "an integer ≥ 0 (0 = no sample plots)")
        generator, discriminator = plain(generator), plain(discriminator)
        g_optimizer, d_optimizer = plain(g_optimizer), plain(d_optimizer)
        given = objects_given(
            generator=generator, discriminator=discriminator, g_optimizer=g_optimizer, d_optimizer=d_optimizer
        )
        self.save_hyperparameters(ignore=given, logger=False)
        self.automatic_optimization = False
        self.g_optimizer_factory = build_optimizer_factory(g_optimizer, "g_optimizer")
        self.d_optimizer_factory = build_optimizer_factory(d_optimizer, "d_optimizer")
        self.loss, self.n_critic, self.gp_weight = loss, n_critic, gp_weight
        self.latent_dim, self.n_plot_samples = latent_dim, n_plot_samples
        self.lr_schedule, self.noise_seed = lr_schedule, noise_seed
        self._noise: torch.Generator | None = None  # made on first use, on the module's device
        self._noise_state: torch.Tensor | None = None  # from a checkpoint, applied when it is made
        self.accumulation = ManualAccumulation(self, accumulate_grad_batches)

        self.generator = build_module(generator, "generator")
        self.discriminator = build_module(discriminator, "discriminator")
        self.sample_shape: tuple[int, ...] | None = None  # a data sample's shape, seen by the component check
        self.mode_coverage: ModeCoverage | None = None  # set in setup() when the data has modes
        self._eval_noise: torch.Generator | None = None  # set at every validation epoch's start

    components: ClassVar[tuple[str, ...]] = ("generator", "discriminator")

    def not_compilable(self, name: str) -> str:
        if name == "discriminator" and self.gp_weight > 0:
            return "the gradient penalty differentiates its gradient, a double backward torch.compile does not support"
        return ""

    def configure_optimizers(self) -> list[Optimizer] | tuple[list[Optimizer], list[LambdaLR]]:
        for key, factory in (("g_optimizer", self.g_optimizer_factory), ("d_optimizer", self.d_optimizer_factory)):
            if factory is None:
                raise ConfigError(
                    f"model.{key}", None, "an optimizer config (optimizer@model.{key}=adam_gan)", "not set"
                )
        # Named param groups: LearningRateMonitor logs `lr-<Optimizer>/generator` and `.../discriminator`.
        opt_g = self.g_optimizer_factory([{"params": self.generator.parameters(), "name": "generator"}])
        opt_d = self.d_optimizer_factory([{"params": self.discriminator.parameters(), "name": "discriminator"}])
        epochs = self.trainer.max_epochs if self._trainer is not None else None
        if self.lr_schedule == "constant" or not epochs or epochs < 1:
            return [opt_g, opt_d]
        # Linear decay to zero over the run, stepped per epoch (on_train_epoch_start; manual optimization
        # steps no scheduler by itself): a GAN at a constant rate keeps circling its equilibrium, and a
        # shrinking step lets it settle where it is instead of at whatever point the last step reached.
        decay = functools.partial(_linear_decay, epochs=epochs)
        return [opt_g, opt_d], [LambdaLR(opt_g, decay), LambdaLR(opt_d, decay)]

    def check_trainer(self, trainer: L.Trainer) -> None:
        """Reject the Trainer settings manual optimization cannot honour (called by `multiloss.train`
        before anything is written); Lightning would refuse them only later, with a traceback."""
        require(
            trainer.accumulate_grad_batches == 1,
            "trainer.accumulate_grad_batches",
            trainer.accumulate_grad_batches,
            f"1; the GAN accumulates each network itself: model.accumulate_grad_batches="
            f"{trainer.accumulate_grad_batches}",
            "Lightning cannot accumulate under manual optimization",
        )
        require(
            trainer.gradient_clip_val is None,
            "trainer.gradient_clip_val",
            trainer.gradient_clip_val,
            "null (this recipe does not clip gradients)",
            "Lightning cannot clip gradients under manual optimization",
        )

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
        self.sample_shape = tuple(real.shape[1:])

    def setup(self, stage: str) -> None:
        super().setup(stage)
        centers = getattr(self.trainer.datamodule, "centers", None)
        if centers is not None and self.mode_coverage is None:
            self.mode_coverage = ModeCoverage(centers, self.trainer.datamodule.std).to(self.device)

    # --- the pieces: noise, the two losses ------------------------------------------------------

    def noise(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` latent vectors (n, latent_dim) and interpolation weights ε ∈ (0, 1) (n, 1) for this rank.

        One draw of one row per sample from the module's noise generator, for the whole global
        batch; this rank keeps every world_size-th row from its rank on, the way the data sampler
        shards the batch. Drawing n per rank would give every rank the same noise (the ranks'
        generators are seeded alike), and drawing z and ε in separate calls would make k
        micro-batches draw differently from one batch of k·b.
        """
        world = self.trainer.world_size if self._trainer is not None else 1
        rows = torch.randn(n * world, self.latent_dim + 1, generator=self._noise_generator(), device=self.device)
        rows = rows[self.global_rank :: world]
        return rows[:, :-1], torch.special.ndtr(rows[:, -1:])  # ndtr: Φ, so ε is uniform

    def _noise_generator(self) -> torch.Generator:
        if self._noise is None:
            self._noise = torch.Generator(device=self.device).manual_seed(self.noise_seed)
            if self._noise_state is not None:
                self._noise.set_state(self._noise_state)
                self._noise_state = None
        return self._noise

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self._noise is not None:
            checkpoint["gan_noise_state"] = self._noise.get_state()  # a uint8 tensor: weights_only loads it

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._noise, self._noise_state = None, checkpoint.get("gan_noise_state")

    def discriminator_losses(
        self, real: torch.Tensor, fake: torch.Tensor, eps: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """D's loss ``d`` and its components; pass detached fakes, and ε (needed when ``gp_weight`` > 0)."""
        # Through D's own DDP wrapper (when there is one): this backward's D gradients are averaged
        # across ranks, and it reaches no other parameters.
        critic = synced(self, "discriminator")
        d_real, d_fake = critic(real), critic(fake)
        if self.loss == "wgan-gp":
            losses = {"d_real": -d_real.mean(), "d_fake": d_fake.mean()}
        else:  # −log σ(D(x)) − log(1 − σ(D(G(z)))), written with softplus for stability
            losses = {"d_real": F.softplus(-d_real).mean(), "d_fake": F.softplus(d_fake).mean()}
        total = losses["d_real"] + losses["d_fake"]
        if self.gp_weight > 0 and eps is not None:
            losses["gp"] = gradient_penalty(critic, real, fake, eps)
            total = total + self.gp_weight * losses["gp"]
        return {**losses, "d": total}

    def generator_loss(self, fake: torch.Tensor) -> torch.Tensor:
        """G's loss through D: the non-saturating −log σ(D(G(z))), or WGAN's −D(G(z)).

        D is called directly, not through its DDP wrapper: its weights are frozen for this step, so
        no D gradient may be expected (or all-reduced) by this backward.
        """
        d_fake = self.discriminator(fake)
        return -d_fake.mean() if self.loss == "wgan-gp" else F.softplus(-d_fake).mean()

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    # --- training -------------------------------------------------------------------------------

    def training_step(self, batch: Any, batch_idx: int) -> None:
        batch = self.named_batch(batch)
        opt_g, opt_d = self.optimizers()
        real = batch["x"]
        every = self.accumulation.every
        last = batch_idx + 1 == self.trainer.num_training_batches

        # Discriminator micro-batch. Inside the block only D's weights require grad (toggle_optimizer);
        # the fakes are detached as well, so D's backward stops at D's input whatever built them.
        # It steps (in place) and zeroes its gradients on every `every`-th micro-batch.
        with self.accumulation.micro_batch(opt_d, batch_idx, last) as backward:
            z, eps = self.noise(len(real))
            fake = self.generator(z).detach()
            d_losses = self.discriminator_losses(real, fake, eps)
            self.log_losses(d_losses, batch_size=len(real))  # before the step: the non-finite guard judges it
            backward(d_losses["d"])

        # Generator step after every n_critic-th D step. G's loss is built only now, through the D
        # that opt_d.step() has just updated in place, never through a graph from before the step.
        if (batch_idx + 1) % (self.n_critic * every) == 0:
            g_losses = []
            for index in range(every):
                with self.accumulation.micro_batch(opt_g, index) as backward:
                    z, _ = self.noise(len(real))
                    g_loss = self.generator_loss(synced(self, "generator")(z))
                    self.report_losses({"g": g_loss})
                    backward(g_loss)
                g_losses.append(g_loss.detach())
            self.log_losses({"g": torch.stack(g_losses).mean()}, batch_size=len(real), report=False)

    # --- validation: losses and mode coverage on a fixed evaluation noise -----------------------

    def on_validation_epoch_start(self) -> None:
        # Its own stream, restarted every epoch: each epoch is scored on the same noise, and validation
        # never moves the global stream the training noise comes from.
        self._eval_noise = torch.Generator(device=self.device).manual_seed(self.global_rank)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        batch = self.named_batch(batch)
        real = batch["x"]
        z = torch.randn(len(real), self.latent_dim, generator=self._eval_noise, device=self.device)
        fake = self.generator(z)
        losses = {"d": self.discriminator_losses(real, fake)["d"], "g": self.generator_loss(fake)}
        self.epoch_means.log(self, losses, f"{self.stage}/loss/", len(real))
        if self.mode_coverage is not None:
            self.mode_coverage.update(fake)

    def on_validation_epoch_end(self) -> None:
        if self.mode_coverage is None:
            return
        # Every rank calls compute() (it gathers the states), whatever its own number of batches.
        scores = self.mode_coverage.compute()
        self.mode_coverage.reset()
        self.log(f"{self.stage}/modes", scores["modes"], prog_bar=True, sync_dist=True)  # equal on all ranks already
        self.log(f"{self.stage}/high_quality", scores["high_quality"], prog_bar=True, sync_dist=True)

    # --- artifacts ------------------------------------------------------------------------------

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        # The schedule is a function of the epoch: bring it up to this batch's. Stepping it at an
        # epoch's end (or start) loses a step when a run stopped by max_steps exactly at an epoch's end
        # is resumed: its checkpoint was taken at the last batch, and Lightning then goes on into the
        # next epoch without calling either hook (7.7e-3 off a straight run).
        for scheduler in self.lr_schedulers() or []:
            while scheduler.last_epoch < self.current_epoch:
                scheduler.step()

    def on_train_epoch_end(self) -> None:
        if self.n_plot_samples and self.trainer.is_global_zero:
            path = Path(self.trainer.default_root_dir) / "samples" / f"epoch_{self.current_epoch:03d}.png"
            self.write_samples(path)

    @torch.no_grad()
    def write_samples(self, path: Path) -> None:
        """Generated points over the real ones (2-D data), or a grid of generated images, as a PNG."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        # Fixed plot noise from a private generator: the epochs' pictures are comparable, and
        # rank zero drawing alone does not desynchronise the ranks' global streams.
        z = torch.randn(self.n_plot_samples, self.latent_dim, generator=torch.Generator().manual_seed(0))
        fake = self.generator(z.to(self.device)).float().cpu()
        images = _as_images(fake)
        if fake[0].numel() == 2:
            fake = fake.reshape(len(fake), 2).numpy()
            fig, ax = plt.subplots(figsize=(4.5, 4.5))
            ax.scatter(fake[:, 0], fake[:, 1], s=4, c="tab:red", alpha=0.5, label="generated")
            datasets = getattr(getattr(self.trainer.datamodule, "train_set", None), "datasets", None)
            if isinstance(datasets, dict) and "x" in datasets:  # on top, small: the targets stay visible
                real = datasets["x"][: self.n_plot_samples].reshape(-1, 2).numpy()
                ax.scatter(real[:, 0], real[:, 1], s=1, c="k", alpha=0.6, label="real")
            ax.set_aspect("equal")
            ax.legend(loc="upper right", fontsize=7, markerscale=3)
        elif images is not None:
            cols = 8
            fig, axes = plt.subplots(math.ceil(len(images) / cols), cols, figsize=(4.5, 4.5), squeeze=False)
            for ax, image in zip(axes.flat, images):
                ax.imshow(image.numpy(), cmap="gray_r" if image.dim() == 2 else None, vmin=0, vmax=1)
            for ax in axes.flat:
                ax.axis("off")
        else:
            return
        fig.suptitle(f"epoch {self.current_epoch}, step {self.step_index}", fontsize=9)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=80)
        plt.close(fig)


def _as_images(samples: torch.Tensor, n: int = 64) -> torch.Tensor | None:
    """Up to ``n`` samples as images in [0, 1] — ``(H, W)`` grey or ``(H, W, 3)`` colour — or None if not images.

    Image-shaped means ``(H, W)``, ``(1, H, W)``, ``(3, H, W)``, or a flat square number of features (8×8 digits).
    """
    samples = samples[:n]
    shape = tuple(samples.shape[1:])
    if len(shape) == 3 and shape[0] in (1, 3):
        images = samples.squeeze(1) if shape[0] == 1 else samples.permute(0, 2, 3, 1)
    elif len(shape) == 2:
        images = samples
    elif len(shape) == 1 and shape[0] > 2 and math.isqrt(shape[0]) ** 2 == shape[0]:
        side = math.isqrt(shape[0])
        images = samples.reshape(-1, side, side)
    else:
        return None
    return images.clamp(0, 1)
