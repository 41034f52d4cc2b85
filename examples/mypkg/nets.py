"""Networks a user brings. Each meets one recipe's contract (see the recipe's docstring) and nothing else.

None of them imports multiloss: a recipe takes any ``nn.Module`` whose ``forward`` returns what the
recipe reads.
"""

from __future__ import annotations

import torch
from torch import nn


class TwoHeadCNN(nn.Module):
    """multihead: a small CNN on 8×8 digits with an auxiliary head after its first conv layer.

    ``forward(x)`` takes the flat 64 pixels and returns ``[aux_logits, final_logits]``, deepest last.
    """

    def __init__(self, num_classes: int = 10, channels: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(1, channels, 3, padding=1), nn.ReLU())
        self.conv2 = nn.Sequential(nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1), nn.ReLU())
        self.aux_head = nn.Linear(channels, num_classes)  # on globally pooled conv1 features
        self.head = nn.Linear(2 * channels * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        h1 = self.conv1(x.view(-1, 1, 8, 8))
        h2 = self.conv2(h1)
        return [self.aux_head(h1.mean(dim=(2, 3))), self.head(h2.flatten(1))]


class ShapesNet(nn.Module):
    """weighted: one conv trunk on 16×16 images, three heads — the shape's class, big or small, its area.

    ``forward(x)`` returns ``{"shape": (batch, 3) logits, "big": (batch,) logit, "area": (batch,)}``.
    """

    def __init__(self, channels: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(channels * 4 * 4, hidden),
            nn.ReLU(),
        )
        self.shape = nn.Linear(hidden, 3)
        self.big = nn.Linear(hidden, 1)
        self.area = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.trunk(x)
        return {"shape": self.shape(h), "big": self.big(h).squeeze(-1), "area": self.area(h).squeeze(-1)}


class _Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


class ResidualGenerator(nn.Module):
    """gan: z -> samples through residual blocks."""

    def __init__(self, latent_dim: int, data_dim: int, width: int = 64, blocks: int = 2) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(latent_dim, width),
            nn.ReLU(),
            *(_Residual(width) for _ in range(blocks)),
            nn.Linear(width, data_dim),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


class ResidualCritic(nn.Module):
    """gan: a sample -> one score, shape (batch,). No BatchNorm: the gradient penalty is per sample."""

    def __init__(self, data_dim: int, width: int = 64, blocks: int = 2) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(data_dim, width), nn.ReLU(), *(_Residual(width) for _ in range(blocks)), nn.Linear(width, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


class GRULanguageModel(nn.Module):
    """tbptt: a GRU over token ids; its state is one tensor (an LSTM's is a tuple: the recipe takes both).

    ``vocab_size`` is left out of the config: the recipe passes the data's (256 for bytes).
    """

    def __init__(self, vocab_size: int, embedding_dim: int = 32, hidden_size: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embedding_dim)
        self.gru = nn.GRU(embedding_dim, hidden_size, batch_first=True)
        self.out = nn.Linear(hidden_size, vocab_size)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        out, hidden = self.gru(self.embed(tokens), hidden)
        return self.out(out), hidden


class SmallMLP(nn.Module):
    """accumulation: any classifier, here two hidden layers on 2-D points."""

    def __init__(self, in_features: int = 2, num_classes: int = 2, hidden: int = 32) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(in_features, hidden),
            nn.Tanh(),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
