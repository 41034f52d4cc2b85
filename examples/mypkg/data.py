"""The example's own data, written as ``.npz`` files (every array becomes a batch key of the same name).

    python -m mypkg.data examples/data      # writes shapes.npz and moons.npz there

Generated from a fixed seed, so every run trains on the same files.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from sklearn.datasets import make_moons


def shapes(n: int = 2000, size: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    """16×16 images of one shape each: ``x`` (n, 1, 16, 16) float32, ``shape`` (0 square, 1 disk, 2 cross),
    ``big`` (side ≥ 8 pixels, bool), ``area`` (the share of lit pixels, float32)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size]
    images = np.zeros((n, 1, size, size), dtype=np.float32)
    kinds = rng.integers(0, 3, n)
    sides = rng.integers(4, 13, n)
    for i, (kind, side) in enumerate(zip(kinds, sides)):
        top, left = rng.integers(0, size - side + 1, 2)
        cy, cx, r = top + (side - 1) / 2, left + (side - 1) / 2, side / 2
        if kind == 0:
            mask = (yy >= top) & (yy < top + side) & (xx >= left) & (xx < left + side)
        elif kind == 1:
            mask = (yy - cy) ** 2 + (xx - cx) ** 2 <= r**2
        else:
            inside = (yy >= top) & (yy < top + side) & (xx >= left) & (xx < left + side)
            mask = inside & ((np.abs(yy - cy) <= side / 6) | (np.abs(xx - cx) <= side / 6))
        images[i, 0][mask] = 1.0
    area = images.reshape(n, -1).mean(axis=1).astype(np.float32)
    return {"x": images, "shape": kinds.astype(np.int64), "big": sides >= 8, "area": area}


def moons(n: int = 2000, seed: int = 0) -> dict[str, np.ndarray]:
    """scikit-learn's two interleaving half circles: ``x`` (n, 2) float32, ``y`` (n,) int64."""
    x, y = make_moons(n, noise=0.15, random_state=seed)
    return {"x": x.astype(np.float32), "y": y.astype(np.int64)}


def write_all(directory: str | Path) -> dict[str, Path]:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"shapes": out / "shapes.npz", "moons": out / "moons.npz"}
    np.savez(paths["shapes"], **shapes())
    np.savez(paths["moons"], **moons())
    return paths


if __name__ == "__main__":
    for name, path in write_all(sys.argv[1] if len(sys.argv) > 1 else "data").items():
        print(f"{name}: {path}")
