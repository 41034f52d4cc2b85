"""Two canonical GAN scripts, their networks and loops, written out in plain PyTorch (no multiloss code).

- DCGAN: pytorch/examples, ``dcgan/main.py`` at 77f55b912142e11fcfdf5b530231fb9c52f181e8: ``weights_init``
  (lines 116-123), ``Generator`` (126-159), ``Discriminator`` (169-200), the loss and optimizers (209-217), the
  loop (222-259): D on real then on ``fake.detach()`` (two backwards), ``optimizerD.step()``, then G's loss
  through ``netD(fake)``, the same ``fake`` tensor, and ``optimizerG.step()``.
- WGAN-GP: eriklindernoren/PyTorch-GAN, ``implementations/wgan_gp/wgan_gp.py`` at
  36d3c77e5ff20ebe0aeefd322326a134a279b93e: ``Generator`` (42-65, BatchNorm1d with eps 0.8 as written),
  ``Discriminator`` (68-83), ``compute_gradient_penalty`` (119-138), the loop (146-193): the critic on
  ``generator(z)`` (not detached: G's grads are zeroed before its own step), then, when ``i % n_critic ==
  0``, G again on the same ``z``.
- The WGAN-GP paper's Algorithm 1 (Gulrajani et al. 2017): ``n_critic`` critic steps, each on a new real
  batch, new noise and new ε, then one generator step on new noise.

Sizes are the scripts' arguments made tiny (``nz``, ``ngf``, ``ndf``, image size). The noise and ε come from
the caller (the GAN recipe's documented stream, `multiloss.testing.gan_noise`): what numpy's and torch's
global streams gave the scripts is the one thing replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

# --- DCGAN -------------------------------------------------------------------------------------------


def dcgan_weights_init(m: nn.Module) -> None:
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


class DCGANGenerator(nn.Module):
    """DCGAN's generator (64×64 images), taking z as ``(batch, nz)`` as the GAN recipe gives it."""

    def __init__(self, nz: int = 8, ngf: int = 8, nc: int = 1) -> None:
        super().__init__()
        self.nz = nz
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 8),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),
            nn.Tanh(),
        )
        self.apply(dcgan_weights_init)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.main(z.view(-1, self.nz, 1, 1))


class DCGANDiscriminator(nn.Module):
    """DCGAN's discriminator (64×64 images). ``sigmoid``: the script's last layer; the recipe takes logits
    (its loss is BCE written on logits), so its port leaves it out."""

    def __init__(self, ndf: int = 8, nc: int = 1, sigmoid: bool = False) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 4),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 8),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False),
            *([nn.Sigmoid()] if sigmoid else []),
        )
        self.apply(dcgan_weights_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x).view(-1, 1).squeeze(1)


def bce_on_logits(logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """``nn.BCELoss()(torch.sigmoid(logits), label)`` for a label of all ones or all zeros, written as softplus(∓l):
    the same function, in the form the GAN recipe computes (BCELoss's own rounding differs in the last bits)."""
    return F.softplus(-logits).mean() if bool(label.all()) else F.softplus(logits).mean()


def dcgan_loop(
    net_g: nn.Module,
    net_d: nn.Module,
    batches: Iterable[torch.Tensor],
    noise: Iterator[torch.Tensor],
    lr: float,
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """dcgan/main.py's training loop (lines 222-259) over ``batches``, ``noise`` one z per iteration.

    ``criterion``: the script's ``nn.BCELoss()`` on its Sigmoid output by default; `bce_on_logits` for a
    discriminator without the Sigmoid.
    """
    criterion = criterion or nn.BCELoss()
    optimizer_d = torch.optim.Adam(net_d.parameters(), lr=lr, betas=(0.5, 0.999))
    optimizer_g = torch.optim.Adam(net_g.parameters(), lr=lr, betas=(0.5, 0.999))
    real_label, fake_label = 1, 0
    for real in batches:
        net_d.zero_grad()
        label = torch.full((real.size(0),), real_label, dtype=real.dtype)
        err_d_real = criterion(net_d(real), label)
        err_d_real.backward()
        fake = net_g(next(noise))
        label.fill_(fake_label)
        err_d_fake = criterion(net_d(fake.detach()), label)
        err_d_fake.backward()
        optimizer_d.step()

        net_g.zero_grad()
        label.fill_(real_label)  # fake labels are real for generator cost
        err_g = criterion(net_d(fake), label)
        err_g.backward()
        optimizer_g.step()


# --- PyTorch-GAN's WGAN-GP ---------------------------------------------------------------------------


class WGANGenerator(nn.Module):
    """wgan_gp.py's generator: 4 linear blocks (BatchNorm1d(·, 0.8) — its eps argument, as written), Tanh."""

    def __init__(self, latent_dim: int = 8, img_size: int = 16, channels: int = 1) -> None:
        super().__init__()
        self.img_shape = (channels, img_size, img_size)

        def block(in_feat: int, out_feat: int, normalize: bool = True) -> list[nn.Module]:
            layers: list[nn.Module] = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(
            *block(latent_dim, 128, normalize=False),
            *block(128, 256),
            *block(256, 512),
            *block(512, 1024),
            nn.Linear(1024, channels * img_size * img_size),
            nn.Tanh(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        img = self.model(z)
        return img.view(img.shape[0], *self.img_shape)


class WGANCritic(nn.Module):
    """wgan_gp.py's discriminator: a linear critic, no BatchNorm, one score per sample."""

    def __init__(self, img_size: int = 16, channels: int = 1) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(channels * img_size * img_size, 512),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(512, 256),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(256, 1),
        )

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        return self.model(img.view(img.shape[0], -1))


def compute_gradient_penalty(d: nn.Module, real: torch.Tensor, fake: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """wgan_gp.py's penalty (lines 119-138), ``alpha`` given instead of drawn from numpy."""
    alpha = alpha.view(-1, 1, 1, 1)
    interpolates = (alpha * real + ((1 - alpha) * fake)).requires_grad_(True)
    d_interpolates = d(interpolates)
    ones = torch.ones(real.shape[0], 1)
    (gradients,) = torch.autograd.grad(
        outputs=d_interpolates, inputs=interpolates, grad_outputs=ones, create_graph=True, retain_graph=True
    )
    gradients = gradients.view(gradients.size(0), -1)
    return ((gradients.norm(2, dim=1) - 1) ** 2).mean()


def pytorch_gan_wgan_gp_loop(
    generator: nn.Module,
    discriminator: nn.Module,
    epochs: Iterable[Iterable[torch.Tensor]],
    noise: Iterator[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    n_critic: int,
    lambda_gp: float,
) -> None:
    """wgan_gp.py's loop (lines 146-193): the critic every batch; G when ``i % n_critic == 0``, on the same z."""
    optimizer_g = torch.optim.Adam(generator.parameters(), lr=lr, betas=(0.5, 0.999))
    optimizer_d = torch.optim.Adam(discriminator.parameters(), lr=lr, betas=(0.5, 0.999))
    for batches in epochs:
        for i, real_imgs in enumerate(batches):
            optimizer_d.zero_grad()
            z, alpha = next(noise)
            fake_imgs = generator(z)
            real_validity = discriminator(real_imgs)
            fake_validity = discriminator(fake_imgs)
            gradient_penalty = compute_gradient_penalty(discriminator, real_imgs.data, fake_imgs.data, alpha)
            d_loss = -torch.mean(real_validity) + torch.mean(fake_validity) + lambda_gp * gradient_penalty
            d_loss.backward()
            optimizer_d.step()

            optimizer_g.zero_grad()
            if i % n_critic == 0:
                fake_imgs = generator(z)
                g_loss = -torch.mean(discriminator(fake_imgs))
                g_loss.backward()
                optimizer_g.step()


def wgan_gp_algorithm_1(
    generator: nn.Module,
    critic: nn.Module,
    batches: Iterable[torch.Tensor],
    noise: Iterator[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    n_critic: int,
    lambda_gp: float,
) -> None:
    """Algorithm 1 of Gulrajani et al. 2017 (Adam as in the paper's β₁ = 0.5 setting here): ``n_critic`` critic
    iterations — each a new real batch, new z and ε, x̃ = G(z), x̂ = εx + (1−ε)x̃, L = D(x̃) − D(x) + λ(‖∇D(x̂)‖ −
    1)² — then one generator step on new noise: −D(G(z))."""
    optimizer_d = torch.optim.Adam(critic.parameters(), lr=lr, betas=(0.5, 0.999))
    optimizer_g = torch.optim.Adam(generator.parameters(), lr=lr, betas=(0.5, 0.999))
    for t, x in enumerate(batches, start=1):
        z, eps = next(noise)
        with torch.no_grad():
            x_tilde = generator(z)
        d_real, d_fake = critic(x), critic(x_tilde)
        eps = eps.view(-1, *[1] * (x.dim() - 1))
        x_hat = (eps * x + (1 - eps) * x_tilde).requires_grad_(True)
        (grad,) = torch.autograd.grad(critic(x_hat).sum(), x_hat, create_graph=True)
        penalty = ((grad.flatten(1).norm(2, dim=1) - 1) ** 2).mean()
        loss = -d_real.mean() + d_fake.mean() + lambda_gp * penalty  # the terms summed in the recipe's order
        optimizer_d.zero_grad()
        loss.backward()
        optimizer_d.step()
        if t % n_critic == 0:
            z, _ = next(noise)
            optimizer_g.zero_grad()
            (-critic(generator(z)).mean()).backward()
            optimizer_g.step()
