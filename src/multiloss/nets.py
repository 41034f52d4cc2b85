"""Small building blocks the recipes share."""

from __future__ import annotations

import itertools

from torch import nn


def dense_block(in_features: int, out_features: int, dropout: float = 0.0, batch_norm: bool = False) -> nn.Sequential:
    """Linear -> [BatchNorm] -> ReLU -> [Dropout].

    BatchNorm and dropout are off by default in the recipes whose proofs need "k micro-batches of b
    == one batch of k·b" and "2 ranks × b == 1 rank × 2b": BatchNorm's statistics depend on the
    micro-batch (and on the rank's shard), dropout's masks on the random stream.
    """
    layers: list[nn.Module] = [nn.Linear(in_features, out_features)]
    if batch_norm:
        layers.append(nn.BatchNorm1d(out_features))
    layers.append(nn.ReLU())
    if dropout > 0:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


def mlp(sizes: list[int], dropout: float = 0.0, batch_norm: bool = False) -> nn.Sequential:
    """Dense blocks through ``sizes[:-1]`` and a plain linear output layer of ``sizes[-1]``."""
    blocks = [dense_block(a, b, dropout, batch_norm) for a, b in itertools.pairwise(sizes[:-1])]
    return nn.Sequential(*blocks, nn.Linear(sizes[-2], sizes[-1]))
