"""Dense scenes with NYUv2's three tasks, generated from a seed and written in LibMTL's NYUv2 layout (ships offline).

    python -m multiloss.data.scenes OUT                        # 800 train + 200 val scenes, 3×64×64
    python -m multiloss.data.scenes OUT --train 2000 --val 400 --size 96 --seed 1

Each scene is ray-cast from a pinhole camera at the origin, tilted per scene (pitch and roll, as a hand-held camera),
looking along its +z with y pointing down as image rows. The room: a floor (the world plane y = 1), a back wall
(z = 8) ending at y = -3.5 — above it the rays meet nothing, NYUv2's unlabelled pixels (label -1, depth 0, normal 0,
which LibMTL's losses and metrics mask) — and 4 to 8 objects standing on the floor, spheres and boxes turned about
the vertical, which hide one another. Object classes 2-12: 2-7 are spheres, 8-12 boxes; each class has a colour
and a stripe texture, jittered per object so that neighbouring classes overlap in colour and shape and size tell
them apart too. The light's direction changes per scene, so shading alone does not give a normal.

Per pixel, from the nearest hit along the ray through the pixel's centre: the class (13: floor 0, wall 1, objects
2-12), the depth (the hit's z in the camera's frame, as NYUv2's depth along the optical axis), the unit surface
normal in the camera's frame (NYUv2's normals: normalised, facing the camera), and the colour: the albedo
(class colour × texture) × (0.2 ambient + 0.8 Lambert) with a little noise — so segmentation, depth and normals
are learnable from the image, and all known exactly.

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
SPHERES, BOXES = range(2, 8), range(8, CLASSES)  # the object classes by shape
FLOOR_Y, WALL_Z, WALL_TOP = 1.0, 8.0, -3.5  # in the world's frame (y down, z forward from the camera)
FOCAL = 1.1  # in units of the image's half width: a ~85° horizontal field of view
_CLASS_RNG = np.random.default_rng(12345)  # the classes' fixed looks, drawn once
COLOURS = _CLASS_RNG.uniform(0.2, 0.9, size=(CLASSES, 3))
STRIPES = _CLASS_RNG.uniform(2.0, 9.0, size=CLASSES)  # stripes per world unit along the class's direction
STRIPE_AXES = _CLASS_RNG.normal(size=(CLASSES, 3))
STRIPE_AXES /= np.linalg.norm(STRIPE_AXES, axis=1, keepdims=True)


@dataclass(frozen=True)
class Sphere:
    center: tuple[float, float, float]  # world frame
    radius: float
    label: int


@dataclass(frozen=True)
class Box:
    center: tuple[float, float, float]  # world frame
    half: tuple[float, float, float]  # half extents along the box's own axes
    turn: float  # radians about the world's vertical
    label: int

    def rotation(self) -> np.ndarray:
        """Box axes → world: columns are the box's x, y, z axes in the world frame."""
        c, s = np.cos(self.turn), np.sin(self.turn)
        return np.array([[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]])


@dataclass(frozen=True)
class Scene:
    """A generated scene's objects and its per-pixel truth (arrays in LibMTL's NYUv2 shapes)."""

    objects: tuple[Sphere | Box, ...]
    camera: np.ndarray  # (3, 3): camera frame → world frame (a world direction is camera @ a camera direction)
    light: np.ndarray  # (3,) unit, towards the light, world frame
    image: np.ndarray  # (H, W, 3) float32 in [0, 1]
    label: np.ndarray  # (H, W) float32: 0..12, -1 where nothing is hit
    depth: np.ndarray  # (H, W, 1) float32: the hit's z in the camera frame, 0 where nothing is hit
    normal: np.ndarray  # (H, W, 3) float32: unit, camera frame, facing the camera; 0 where nothing is hit


def rays(size: int) -> np.ndarray:
    """(size, size, 3) unit directions, camera frame, of the rays through the pixels' centres (x right, y down)."""
    centres = (np.arange(size) + 0.5) / size * 2 - 1  # -1..1 across the image
    x, y = np.meshgrid(centres, centres)  # x along columns, y along rows (down)
    d = np.stack([x / FOCAL, y / FOCAL, np.ones_like(x)], axis=-1)
    return d / np.linalg.norm(d, axis=-1, keepdims=True)


def camera(pitch: float, roll: float) -> np.ndarray:
    """Camera frame → world frame for a camera pitched (about x, positive looks down) and rolled (about z)."""
    cp, sp, cr, sr = np.cos(pitch), np.sin(pitch), np.cos(roll), np.sin(roll)
    pitch_m = np.array([[1.0, 0.0, 0.0], [0.0, cp, sp], [0.0, -sp, cp]])
    roll_m = np.array([[cr, -sr, 0.0], [sr, cr, 0.0], [0.0, 0.0, 1.0]])
    return pitch_m @ roll_m


def hit_sphere(d: np.ndarray, sphere: Sphere) -> tuple[np.ndarray, np.ndarray]:
    """Rays ``d`` (world frame, from the origin): the near root t of |t·d - c|² = r² (inf on a miss), the normals."""
    c = np.array(sphere.center)
    b = d @ c
    disc = b**2 - c @ c + sphere.radius**2
    t = np.where(disc >= 0, b - np.sqrt(np.maximum(disc, 0)), np.inf)
    t = np.where(t > 0, t, np.inf)
    with np.errstate(invalid="ignore"):
        normal = (t[..., None] * d - c) / sphere.radius
    return t, normal


def hit_box(d: np.ndarray, box: Box) -> tuple[np.ndarray, np.ndarray]:
    """Rays ``d`` (world frame, from the origin): the entry t through the box's slabs (inf on a miss), the normals."""
    rot, c, half = box.rotation(), np.array(box.center), np.array(box.half)
    o_local, d_local = rot.T @ -c, d @ rot  # the ray in the box's frame
    with np.errstate(divide="ignore", invalid="ignore"):
        t1, t2 = (-half - o_local) / d_local, (half - o_local) / d_local
    near, far = np.minimum(t1, t2), np.maximum(t1, t2)
    near = np.where(np.isnan(near), -np.inf, near)  # a ray parallel to a slab (inside it: the origin is outside)
    far = np.where(np.isnan(far), np.inf, far)
    t_in, t_out = near.max(axis=-1), far.min(axis=-1)
    t = np.where((t_in <= t_out) & (t_in > 0), t_in, np.inf)
    axis = near.argmax(axis=-1)  # the face the ray enters by
    normal_local = np.zeros_like(d)
    np.put_along_axis(normal_local, axis[..., None], -np.sign(np.take_along_axis(d_local, axis[..., None], -1)), -1)
    return t, normal_local @ rot.T


def _objects(rng: np.random.Generator) -> list[Sphere | Box]:
    objects: list[Sphere | Box] = []
    for _ in range(int(rng.integers(4, 9))):
        z = float(rng.uniform(2.2, 7.0))
        x = float(rng.uniform(-0.8, 0.8) * z / FOCAL)  # about inside the view at its depth
        label = int(rng.integers(2, CLASSES))
        if label in SPHERES:
            radius = float(rng.uniform(0.3, 1.1))
            objects.append(Sphere((x, FLOOR_Y - radius, z), radius, label))
        else:
            half = tuple(float(h) for h in rng.uniform(0.25, 0.9, size=3))
            objects.append(Box((x, FLOOR_Y - half[1], z), half, float(rng.uniform(0, np.pi / 2)), label))
    return objects


def _albedo(label: np.ndarray, point: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The class's colour, jittered per scene, times its stripes (along its own direction in the world)."""
    colours = np.clip(COLOURS + rng.normal(0, 0.08, size=COLOURS.shape), 0.05, 1.0)
    cls = np.clip(label, 0, None)
    phase = STRIPES[cls] * np.einsum("hwk,hwk->hw", point, STRIPE_AXES[cls])
    return colours[cls] * (0.7 + 0.3 * (np.sin(2 * np.pi * phase) > 0))[..., None]


def render(rng: np.random.Generator, size: int = 64) -> Scene:
    """One scene drawn from ``rng`` (camera, light, objects, colours and noise), ray-cast at ``size`` × ``size``."""
    to_world = camera(float(rng.uniform(-0.05, 0.3)), float(rng.uniform(-0.15, 0.15)))
    light = np.array([rng.uniform(-1, 1), rng.uniform(-1, -0.3), rng.uniform(-1, 0.2)])
    light /= np.linalg.norm(light)
    objects = _objects(rng)
    d_cam = rays(size).astype(np.float64)
    d = d_cam @ to_world.T  # world-frame directions
    t_best = np.full(d.shape[:2], np.inf)
    label = np.full(d.shape[:2], -1, dtype=np.int64)
    normal = np.zeros(d.shape, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        t_floor = np.where(d[..., 1] > 0, FLOOR_Y / d[..., 1], np.inf)
        t_wall = np.where(d[..., 2] > 0, WALL_Z / d[..., 2], np.inf)
        wall_y = t_wall * d[..., 1]
    t_wall = np.where((wall_y >= WALL_TOP) & (wall_y <= FLOOR_Y), t_wall, np.inf)
    planes = [
        (t_floor, np.broadcast_to([0.0, -1.0, 0.0], d.shape)),
        (t_wall, np.broadcast_to([0.0, 0.0, -1.0], d.shape)),
    ]
    solids = [hit_sphere(d, obj) if isinstance(obj, Sphere) else hit_box(d, obj) for obj in objects]
    for (t, n), cls in zip(planes + solids, [0, 1] + [obj.label for obj in objects], strict=True):
        hit = t < t_best
        t_best = np.where(hit, t, t_best)
        label[hit] = cls
        normal[hit] = n[hit]
    seen = np.isfinite(t_best)
    point = np.where(seen[..., None], np.where(seen, t_best, 0)[..., None] * d, 0.0)
    depth = np.where(seen, t_best, 0.0) * d_cam[..., 2]
    shade = 0.2 + 0.8 * np.clip(normal @ light, 0, None)
    image = _albedo(label, point, rng) * shade[..., None] + rng.normal(0, 0.03, size=d.shape)
    image = np.where(seen[..., None], np.clip(image, 0, 1), 0.0)
    return Scene(
        tuple(objects),
        to_world,
        light,
        image.astype(np.float32),
        label.astype(np.float32),
        depth[..., None].astype(np.float32),
        (normal @ to_world).astype(np.float32),  # world → camera frame: to_world is orthonormal
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
