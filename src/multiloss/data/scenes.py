"""Dense scenes with NYUv2's three tasks, generated from a seed and written in LibMTL's NYUv2 layout (ships offline).

    python -m multiloss.data.scenes OUT                        # 800 train + 200 val scenes, 3×64×64
    python -m multiloss.data.scenes OUT --train 2000 --val 400 --size 96 --seed 1

Each scene is ray-cast from a pinhole camera at the origin looking along +z (y points down, as image rows): a floor
(the plane y = 1), a back wall (z = 8) that ends at y = -5 — above it the rays meet nothing, NYUv2's unlabelled
pixels (label -1, depth 0, normal 0, which LibMTL's losses and metrics mask) — and 3 to 6 spheres resting on the
floor, each of one of 11 object classes. Per pixel, from the nearest hit along the ray through the pixel's centre:
the class (13: floor 0, wall 1, spheres 2-12), the depth (the hit's z, as NYUv2's depth along the optical axis), the
unit surface normal in camera coordinates (NYUv2's normals: normalised, facing the camera), and the colour: the
class's albedo (jittered per scene) × (0.15 ambient + 0.85 Lambert from one light) with a little noise — so
segmentation, depth and normals are all learnable from the image, and all known exactly.

Written as LibMTL's ``create_dataset.py`` reads NYUv2: ``OUT/{train,val}/{image,label,depth,normal}/<i>.npy`` with
image (H, W, 3), label (H, W) float with -1 void, depth (H, W, 1), normal (H, W, 3), all float32 — so
``data=samples data.path=OUT`` with LibMTL's ``channels_last`` and ``dtypes`` serves these scenes and a user's real
NYUv2 copy alike (`configs/experiment/scenes.yaml`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CLASSES = 13  # NYUv2's 13-class segmentation
FLOOR_Y, WALL_Z, WALL_TOP = 1.0, 8.0, -5.0
FOCAL = 1.1  # in units of the image's half width: a ~85° horizontal field of view
LIGHT = np.array([-0.4, -0.8, -0.45]) / np.linalg.norm([-0.4, -0.8, -0.45])  # towards the light (up, left, back)


@dataclass(frozen=True)
class Sphere:
    center: tuple[float, float, float]
    radius: float
    label: int


@dataclass(frozen=True)
class Scene:
    """A generated scene's objects and its per-pixel truth (arrays in LibMTL's NYUv2 shapes)."""

    spheres: tuple[Sphere, ...]
    image: np.ndarray  # (H, W, 3) float32 in [0, 1]
    label: np.ndarray  # (H, W) float32: 0..12, -1 where nothing is hit
    depth: np.ndarray  # (H, W, 1) float32: the hit's z, 0 where nothing is hit
    normal: np.ndarray  # (H, W, 3) float32: unit, facing the camera; 0 where nothing is hit


def rays(size: int) -> np.ndarray:
    """(size, size, 3) unit directions of the rays through the pixels' centres (x right, y down, z forward)."""
    centres = (np.arange(size) + 0.5) / size * 2 - 1  # -1..1 across the image
    x, y = np.meshgrid(centres, centres)  # x along columns, y along rows (down)
    d = np.stack([x / FOCAL, y / FOCAL, np.ones_like(x)], axis=-1)
    return d / np.linalg.norm(d, axis=-1, keepdims=True)


def _palette(rng: np.random.Generator) -> np.ndarray:
    base = np.random.default_rng(12345).uniform(0.15, 0.95, size=(CLASSES, 3))  # fixed per class
    return np.clip(base + rng.normal(0, 0.04, size=base.shape), 0.05, 1.0)  # jittered per scene


def render(rng: np.random.Generator, size: int = 64) -> Scene:
    """One scene drawn from ``rng`` (its spheres, albedos and noise), ray-cast at ``size`` × ``size``."""
    spheres = []
    for _ in range(int(rng.integers(3, 7))):
        radius = float(rng.uniform(0.4, 1.2))
        z = float(rng.uniform(2.5, 6.5))
        x = float(rng.uniform(-0.7, 0.7) * z / FOCAL)  # inside the view at its depth
        spheres.append(Sphere((x, FLOOR_Y - radius, z), radius, int(rng.integers(2, CLASSES))))
    d = rays(size).astype(np.float64)
    t_best = np.full(d.shape[:2], np.inf)
    label = np.full(d.shape[:2], -1, dtype=np.int64)
    normal = np.zeros(d.shape, dtype=np.float64)
    # The floor (y = FLOOR_Y, rays going down) and the wall (z = WALL_Z, up to WALL_TOP).
    with np.errstate(divide="ignore", invalid="ignore"):
        t_floor = np.where(d[..., 1] > 0, FLOOR_Y / d[..., 1], np.inf)
        t_wall = WALL_Z / d[..., 2]
    wall_y = t_wall * d[..., 1]
    t_wall = np.where((wall_y >= WALL_TOP) & (wall_y <= FLOOR_Y), t_wall, np.inf)
    for t, cls, n in ((t_floor, 0, (0.0, -1.0, 0.0)), (t_wall, 1, (0.0, 0.0, -1.0))):
        hit = t < t_best
        t_best = np.where(hit, t, t_best)
        label[hit], normal[hit] = cls, n
    for sphere in spheres:  # |t·d - c|² = r²: t = d·c - sqrt((d·c)² - |c|² + r²), the near root
        c = np.array(sphere.center)
        b = d @ c
        disc = b**2 - c @ c + sphere.radius**2
        with np.errstate(invalid="ignore"):
            t = np.where(disc >= 0, b - np.sqrt(np.maximum(disc, 0)), np.inf)
        hit = (t > 0) & (t < t_best)
        t_best = np.where(hit, t, t_best)
        label[hit] = sphere.label
        normal[hit] = (t[hit, None] * d[hit] - c) / sphere.radius
    seen = np.isfinite(t_best)
    depth = np.where(seen, t_best * d[..., 2], 0.0)
    albedo = _palette(rng)[np.clip(label, 0, None)]
    shade = 0.15 + 0.85 * np.clip(normal @ LIGHT, 0, None)
    image = albedo * shade[..., None] + rng.normal(0, 0.02, size=albedo.shape)
    image = np.where(seen[..., None], np.clip(image, 0, 1), 0.0)
    return Scene(
        tuple(spheres),
        image.astype(np.float32),
        label.astype(np.float32),
        depth[..., None].astype(np.float32),
        normal.astype(np.float32),
    )


def write(out: Path, train: int = 800, val: int = 200, size: int = 64, seed: int = 0) -> Path:
    """``train`` + ``val`` scenes from ``seed`` (scene i of a part from its own stream: the same scene whatever the
    count), in LibMTL's NYUv2 layout under ``out``."""
    for part, count, stream in (("train", train, 0), ("val", val, 1)):
        folders = {key: out / part / key for key in ("image", "label", "depth", "normal")}
        for folder in folders.values():
            folder.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            scene = render(np.random.default_rng([seed, stream, i]), size)
            for key, folder in folders.items():
                np.save(folder / f"{i}.npy", getattr(scene, key))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder to write (train/ and val/ in LibMTL's NYUv2 layout)")
    parser.add_argument("--train", type=int, default=800, help="training scenes (800)")
    parser.add_argument("--val", type=int, default=200, help="validation scenes (200)")
    parser.add_argument("--size", type=int, default=64, help="height and width in pixels (64)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"out={args.out} exists and is not empty: give a new folder (nothing was written)")
    if min(args.train, args.val) < 1 or args.size < 8:
        parser.error("--train and --val must be ≥ 1, --size ≥ 8")
    print(write(args.out, args.train, args.val, args.size, args.seed))


if __name__ == "__main__":
    main()
