"""The networks multiloss ships: the default options of the ``net``, ``generator`` and ``discriminator`` groups.

Each is an ordinary ``nn.Module`` whose constructor takes plain numbers, so a config names it with
``_target_`` and its arguments, and a checkpoint stores that config instead of the module. A user's
own network takes the same place by meeting the recipe's contract (see each recipe's docstring):

- `DeepSupervisionMLP` (multihead): ``forward(x)`` -> a list of logits, one per head, deepest last.
- `MultiTaskMLP` (weighted): ``forward(x)`` -> a dict task name -> output.
- `MLP` (accumulation's classifier; the GAN's generator and discriminator): ``forward(x)`` -> one tensor.
- `CharLSTM` (tbptt): ``forward(tokens, hidden=None)`` -> ``(logits, hidden)``.

No BatchNorm or dropout unless asked: with either, k micro-batches of b stop being one batch of k·b
(BatchNorm normalises each micro-batch by its own statistics, dropout draws other masks), and so do
2 ranks × b and 1 rank × 2b.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from multiloss.config import require


def dense_block(in_features: int, out_features: int, dropout: float = 0.0, batch_norm: bool = False) -> nn.Sequential:
    """Linear -> [BatchNorm] -> ReLU -> [Dropout]."""
    layers: list[nn.Module] = [nn.Linear(in_features, out_features)]
    if batch_norm:
        layers.append(nn.BatchNorm1d(out_features))
    layers.append(nn.ReLU())
    if dropout > 0:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


def dense_blocks(in_features: int, width: int, depth: int, dropout: float, batch_norm: bool) -> list[nn.Sequential]:
    """``depth`` dense blocks from ``in_features`` to ``width`` units: the trunk of every shipped net."""
    sizes = [in_features] + [width] * depth
    return [dense_block(a, b, dropout, batch_norm) for a, b in itertools.pairwise(sizes)]


def check_sizes(**sizes: int) -> None:
    """`ConfigError` naming the first size that is not an integer ≥ 1."""
    for key, value in sizes.items():
        require(isinstance(value, int) and value >= 1, key, value, "an integer ≥ 1")


def _check_regularisation(dropout: float, depth: int) -> None:
    require(0 <= dropout < 1, "dropout", dropout, "a probability in [0, 1)")
    require(isinstance(depth, int) and depth >= 0, "depth", depth, "an integer ≥ 0 (the number of hidden blocks)")


class MLP(nn.Sequential):
    """``depth`` dense blocks of ``width`` units, then a linear layer to ``out_features`` (depth 0: linear only).

    Raises:
        ConfigError: a size < 1, ``depth`` < 0 or ``dropout`` outside [0, 1).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        width: int = 128,
        depth: int = 2,
        dropout: float = 0.0,
        batch_norm: bool = False,
    ) -> None:
        check_sizes(in_features=in_features, out_features=out_features, width=width)
        _check_regularisation(dropout, depth)
        blocks = dense_blocks(in_features, width, depth, dropout, batch_norm)
        super().__init__(*blocks, nn.Linear(width if depth else in_features, out_features))


class DeepSupervisionMLP(nn.Module):
    """A trunk of ``depth`` dense blocks with a classifier head after each (GoogLeNet-style auxiliary heads).

    ``forward(x)`` returns every head's logits, shallowest first: the last entry is the final classifier.

    Raises:
        ConfigError: a size < 1, ``depth`` < 1 or ``dropout`` outside [0, 1).
    """

    def __init__(
        self,
        in_features: int = 64,
        num_classes: int = 10,
        width: int = 128,
        depth: int = 3,
        dropout: float = 0.0,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        check_sizes(in_features=in_features, num_classes=num_classes, width=width)
        _check_regularisation(dropout, depth)
        require(depth >= 1, "depth", depth, "an integer ≥ 1 (the number of blocks, and of heads)")
        self.blocks = nn.ModuleList(dense_blocks(in_features, width, depth, dropout, batch_norm))
        self.heads = nn.ModuleList(nn.Linear(width, num_classes) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        logits = []
        for block, head in zip(self.blocks, self.heads):
            x = block(x)
            logits.append(head(x))
        return logits


class MultiTaskMLP(nn.Module):
    """A shared trunk of ``depth`` dense blocks and one linear head per task: ``heads`` maps name -> outputs.

    ``forward(x)`` returns a dict name -> output; a head of one output gives shape ``(batch,)`` (what a
    binary cross-entropy or a regression loss compares with a ``(batch,)`` target), wider heads
    ``(batch, n)``.

    Raises:
        ConfigError: no heads, a head size or other size < 1, ``depth`` < 0 or ``dropout`` outside [0, 1).
    """

    def __init__(
        self,
        heads: dict[str, int],
        in_features: int = 64,
        width: int = 128,
        depth: int = 2,
        dropout: float = 0.0,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        require(len(heads) >= 1, "heads", heads, "a mapping task name -> number of outputs, e.g. {digit: 10}")
        check_sizes(in_features=in_features, width=width, **{f"heads.{k}": v for k, v in heads.items()})
        _check_regularisation(dropout, depth)
        self.trunk = nn.Sequential(*dense_blocks(in_features, width, depth, dropout, batch_norm))
        features = width if depth else in_features
        self.heads = nn.ModuleDict({name: nn.Linear(features, size) for name, size in heads.items()})

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.trunk(x)
        out = {}
        for name, head in self.heads.items():
            y = head(h)
            # A tensor of its own, not a view of the head's: out of an FSDP2 unit a view would make torch warn that an
            # in-place op on it could skip the unit's all-gather (none is made on it; the copy is n numbers).
            out[name] = y.squeeze(-1).clone() if head.out_features == 1 else y
        return out


class CharLSTM(nn.Module):
    """Token embedding -> LSTM -> linear head to ``vocab_size`` logits per position.

    ``forward(tokens, hidden=None)`` takes ids ``(batch, time)`` and returns logits
    ``(batch, time, vocab_size)`` and the state ``(h, c)`` after the last position. The tbptt recipe
    passes ``vocab_size`` (the data's vocabulary) when the config leaves it out.

    Raises:
        ConfigError: a size < 1.
    """

    def __init__(self, vocab_size: int, embedding_dim: int = 48, hidden_size: int = 192, num_layers: int = 1) -> None:
        super().__init__()
        check_sizes(vocab_size=vocab_size, embedding_dim=embedding_dim, hidden_size=hidden_size, num_layers=num_layers)
        self.embed = nn.Embedding(vocab_size, embedding_dim)
        self.lstm = nn.LSTM(embedding_dim, hidden_size, num_layers=num_layers, batch_first=True)
        self.head = nn.Linear(hidden_size, vocab_size)

    def forward(self, tokens: torch.Tensor, hidden: Any = None) -> tuple[torch.Tensor, Any]:
        out, hidden = self._recur(self.embed(tokens), hidden)
        return self.head(out), hidden

    def _recur(self, x: torch.Tensor, hidden: Any) -> tuple[torch.Tensor, Any]:
        """The LSTM; in fp32 under a CPU's bf16 autocast when oneDNN has no bf16 LSTM for this CPU (it needs AVX-512:
        on an AVX2 CPU torch 2.13 raises "could not create a primitive descriptor for the LSTM"), the rest bf16."""
        on_cpu_autocast = x.device.type == "cpu" and torch.is_autocast_enabled("cpu")
        if on_cpu_autocast and getattr(self, "_lstm_in_fp32", False):
            with torch.autocast("cpu", enabled=False):
                return self.lstm(x.float(), apply_to_collection(hidden, torch.Tensor, torch.Tensor.float))
        try:
            return self.lstm(x, hidden)
        except RuntimeError as err:
            if not (on_cpu_autocast and "primitive descriptor for the LSTM" in str(err)):
                raise
            rank_zero_warn("CharLSTM: this CPU has no bf16 LSTM (oneDNN needs AVX-512): the LSTM runs in fp32")
            self._lstm_in_fp32 = True
            return self._recur(x, hidden)


def repackage_hidden(hidden: Any) -> Any:
    """Keep a recurrent state's values, cut its graph: the next chunk's backward stops here.

    Tree-wise, so an LSTM's ``(h, c)`` (both of them: detaching only ``h`` leaves the cell state
    chained to the freed graph), a GRU's tensor or any nested structure of tensors is cut whole.
    """
    return apply_to_collection(hidden, torch.Tensor, torch.Tensor.detach)


def _conv(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False), nn.BatchNorm2d(out_channels), nn.ReLU()
    )


class _Residual(nn.Module):
    """A ResNet basic block (two 3×3 convolutions, the input added), halving the size with ``stride=2``."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(),
            nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False),
            nn.BatchNorm2d(out_channels),
        )
        self.skip = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


class DenseMultiTaskNet(nn.Module):
    """A shared encoder and one decoder per task, each decoder back to the input's size: the dense-prediction nets of
    NYUv2 (segmentation, depth, surface normals) at a laptop's size. ``heads``: task name -> output channels.

    ``encoder="segnet"``: SegNet's (Badrinarayanan et al. 2017; LibMTL's ``main_segnet.py`` shares it): ``depth``
    stages of two Conv3×3-BatchNorm-ReLU and a 2×2 max-pool, each decoder unpooling with the encoder's pooling indices
    then two convolutions per stage. ``encoder="resnet"``: a 3×3 stem and ``depth`` ResNet basic blocks of stride 2,
    each decoder upsampling (bilinear) then a convolution per stage. Channels: ``width`` doubling per stage. The
    encoder's output is where every task's path meets: the representation ``model.balancer.rep_grad`` works on.
    ``forward(x)`` -> {task: (B, channels, H, W)}.
    """

    def __init__(
        self, heads: dict[str, int], in_channels: int = 3, width: int = 16, depth: int = 3, encoder: str = "segnet"
    ) -> None:
        super().__init__()
        require(len(heads) >= 1, "heads", heads, "a mapping task name -> output channels, e.g. {segmentation: 13}")
        check_sizes(in_channels=in_channels, width=width, depth=depth, **{f"heads.{k}": v for k, v in heads.items()})
        require(encoder in ("segnet", "resnet"), "encoder", encoder, "segnet or resnet")
        self.encoder_kind, self.depth = encoder, depth
        widths = [width * 2**i for i in range(depth)]
        if encoder == "segnet":
            self.stages = nn.ModuleList(
                nn.Sequential(_conv(c_in, c_out), _conv(c_out, c_out))
                for c_in, c_out in zip([in_channels, *widths[:-1]], widths)
            )
            self.pool = nn.MaxPool2d(2, return_indices=True)
        else:
            self.stem = _conv(in_channels, width)
            self.stages = nn.ModuleList(_Residual(c_in, c_out, 2) for c_in, c_out in zip([width, *widths[:-1]], widths))
        self.decoders = nn.ModuleDict({name: self._decoder(widths, width, size) for name, size in heads.items()})

    def _decoder(self, widths: list[int], width: int, outputs: int) -> nn.ModuleDict:
        ups = [widths[i - 1] if i > 0 else width for i in range(len(widths))]  # each stage back to the one before
        stages = nn.ModuleList(
            nn.Sequential(_conv(c_in, c_in), _conv(c_in, c_out))
            if self.encoder_kind == "segnet"
            else _conv(c_in, c_out)
            for c_in, c_out in zip(reversed(widths), reversed(ups))
        )
        return nn.ModuleDict({"stages": stages, "out": nn.Conv2d(width, outputs, 1)})

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Size]]]:
        """The representation, and what the decoders need to go back up (SegNet's indices and sizes)."""
        way = []
        if self.encoder_kind == "segnet":
            for stage in self.stages:
                x = stage(x)
                size = x.shape
                x, indices = self.pool(x)
                way.append((indices, size))
        else:
            x = self.stem(x)
            for stage in self.stages:
                way.append((None, x.shape))
                x = stage(x)
        return x, way

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        rep, way = self.encode(x)
        out = {}
        for name, decoder in self.decoders.items():
            h = rep
            for stage, (indices, size) in zip(decoder["stages"], reversed(way)):
                if indices is not None:
                    h = nn.functional.max_unpool2d(h, indices, 2, output_size=size[-2:])
                else:
                    h = nn.functional.interpolate(h, size=size[-2:], mode="bilinear", align_corners=False)
                h = stage(h)
            out[name] = decoder["out"](h)
        return out
