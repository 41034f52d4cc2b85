"""The dense scenes (`multiloss.data.scenes`): every pixel's depth and normal are the analytic ones of the surface its
ray meets first, checked against an independent ray-sphere solve here; the scenes are LibMTL's NYUv2 layout and the
samples data module serves them as it serves NYUv2."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiloss.data import scenes
from multiloss.data.samples import SamplesDataModule


@pytest.fixture(scope="module")
def scene() -> scenes.Scene:
    found = next(  # a scene with both kinds of object in view
        s
        for i in range(50)
        for s in [scenes.render(np.random.default_rng([7, 0, i]), 48)]
        if {int(v) for v in np.unique(s.label)} & set(scenes.SPHERES)
        and {int(v) for v in np.unique(s.label)} & set(scenes.BOXES)
    )
    return found


def _points(scene: scenes.Scene) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each pixel's ray (world frame), the world point its depth puts on it (depth is the hit's camera z: t =
    depth / d_z) and its normal in the world frame."""
    d_cam = scenes.rays(scene.depth.shape[0])
    t = scene.depth[..., 0:1] / d_cam[..., 2:3]
    return d_cam @ scene.camera.T, t * (d_cam @ scene.camera.T), scene.normal @ scene.camera.T


def test_the_camera_is_a_rotation_and_its_tilt_changes_per_scene(scene):
    np.testing.assert_allclose(scene.camera @ scene.camera.T, np.eye(3), atol=1e-12)
    other = scenes.render(np.random.default_rng([7, 0, 99]), 8)
    assert not np.allclose(other.camera, scene.camera) and not np.allclose(other.light, scene.light)


def test_floor_and_wall_pixels_lie_on_their_planes_with_their_normals(scene):
    _, p, n = _points(scene)
    floor, wall = scene.label == 0, scene.label == 1
    assert floor.sum() > 100 and wall.sum() > 100
    np.testing.assert_allclose(p[floor][:, 1], scenes.FLOOR_Y, rtol=1e-5)
    np.testing.assert_allclose(p[wall][:, 2], scenes.WALL_Z, rtol=1e-5)
    assert np.all(p[wall][:, 1] >= scenes.WALL_TOP - 1e-4)
    np.testing.assert_allclose(n[floor], np.broadcast_to([0, -1, 0], (floor.sum(), 3)), atol=1e-6)
    np.testing.assert_allclose(n[wall], np.broadcast_to([0, 0, -1], (wall.sum(), 3)), atol=1e-6)
    # In the camera's own frame the floor's normal is the tilted one (not the world's): NYUv2's normals.
    np.testing.assert_allclose(scene.normal[floor][0], scene.camera.T @ [0, -1, 0], atol=1e-6)


def test_object_pixels_lie_on_their_sphere_or_box_face_with_its_normal(scene):
    _, p, n = _points(scene)
    checked = 0
    for obj in scene.objects:
        if isinstance(obj, scenes.Sphere):
            c = np.array(obj.center)
            on = (scene.label == obj.label) & (np.abs(np.linalg.norm(p - c, axis=-1) - obj.radius) < 1e-3)
            if on.any():
                np.testing.assert_allclose(np.linalg.norm(p[on] - c, axis=-1), obj.radius, rtol=1e-5)
                np.testing.assert_allclose(n[on], (p[on] - c) / obj.radius, atol=1e-5)
        else:  # in the box's frame: inside every slab, on one face, the normal that face's axis
            local = (p - np.array(obj.center)) @ obj.rotation()
            half = np.array(obj.half)
            on = (scene.label == obj.label) & np.all(np.abs(local) <= half + 1e-3, axis=-1)
            if on.any():
                face = np.abs(np.abs(local[on]) - half).argmin(axis=-1)
                np.testing.assert_allclose(np.abs(local[on])[np.arange(len(face)), face], half[face], rtol=1e-4)
                expected = np.zeros((len(face), 3))
                expected[np.arange(len(face)), face] = np.sign(local[on][np.arange(len(face)), face])
                np.testing.assert_allclose(n[on] @ obj.rotation(), expected, atol=1e-5)
        checked += on.sum()
    labelled = np.isin(scene.label, [o.label for o in scene.objects]).sum()
    assert checked == labelled > 50  # every object pixel lies on an object of its class


def _face_hits(ray: np.ndarray, box: scenes.Box) -> list[float]:
    """A box's six faces as planes, independently of the slab method: t where the ray meets a face inside it."""
    rot, c, half = box.rotation(), np.array(box.center), np.array(box.half)
    found = []
    for axis in range(3):
        for sign in (-1, 1):
            normal = rot[:, axis] * sign
            denominator = ray @ normal
            if abs(denominator) < 1e-12:
                continue
            t = (c + normal * half[axis]) @ normal / denominator
            local = (t * ray - c) @ rot
            others = [k for k in range(3) if k != axis]
            if t > 0 and np.all(np.abs(local[others]) <= half[others] + 1e-9):
                found.append(float(t))
    return found


def test_every_pixel_is_the_nearest_hit_of_an_independent_ray_cast(scene):
    """The first surface along each ray, from the quadratic's roots (np.roots), each box face as a plane and the
    room's planes, per pixel: its label and depth are the rendered ones, its normal faces the camera."""
    d_cam = scenes.rays(scene.depth.shape[0])
    d = d_cam @ scene.camera.T
    for row, col in np.random.default_rng(0).integers(0, d.shape[0], size=(200, 2)):
        ray = d[row, col]
        hits = []  # (t, label)
        if ray[1] > 0:
            hits.append((scenes.FLOOR_Y / ray[1], 0))
        t_wall = scenes.WALL_Z / ray[2]
        if scenes.WALL_TOP <= t_wall * ray[1] <= scenes.FLOOR_Y:
            hits.append((t_wall, 1))
        for obj in scene.objects:
            if isinstance(obj, scenes.Sphere):
                c = np.array(obj.center)
                roots = np.roots([ray @ ray, -2 * ray @ c, c @ c - obj.radius**2])
                hits += [(float(t.real), obj.label) for t in roots if abs(t.imag) < 1e-12 and t.real > 0]
            else:
                hits += [(t, obj.label) for t in _face_hits(ray, obj)]
        if not hits:
            assert (scene.label[row, col], scene.depth[row, col, 0]) == (-1, 0)
            assert not scene.normal[row, col].any() and not scene.image[row, col].any()
            continue
        t, label = min(hits)
        assert scene.label[row, col] == label, (row, col)
        np.testing.assert_allclose(scene.depth[row, col, 0], t * d_cam[row, col, 2], rtol=1e-5)
        assert scene.normal[row, col] @ d_cam[row, col] < 0  # facing the camera


def test_normals_are_unit_where_something_is_hit_and_the_shapes_are_libmtls(scene):
    seen = scene.label >= 0
    np.testing.assert_allclose(np.linalg.norm(scene.normal[seen], axis=-1), 1.0, atol=1e-6)
    assert (scene.image.shape, scene.label.shape, scene.depth.shape, scene.normal.shape) == (
        (48, 48, 3),
        (48, 48),
        (48, 48, 1),
        (48, 48, 3),
    )
    assert {a.dtype for a in (scene.image, scene.label, scene.depth, scene.normal)} == {np.dtype(np.float32)}
    assert set(np.unique(scene.label)) <= set(range(-1, scenes.CLASSES))
    void = [(scenes.render(np.random.default_rng([7, 0, i]), 16).label < 0).mean() for i in range(40)]
    assert 0.08 < np.mean(void) < 0.3  # NYUv2-like unlabelled pixels, masked by its losses and metrics


def test_written_scenes_are_libmtls_nyuv2_layout_and_the_samples_module_serves_them(tmp_path):
    out = scenes.write(tmp_path / "scenes", train=5, val=2, size=16, seed=3)
    assert sorted(p.name for p in (out / "train").iterdir()) == ["depth", "image", "label", "normal"]
    dm = SamplesDataModule(
        str(out), channels_last=["x", "depth", "normal"], dtypes={"label": "int64"}, batch_size=5, shuffle=False
    )
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert {k: tuple(v.shape) for k, v in batch.items()} == {
        "x": (5, 3, 16, 16),
        "label": (5, 16, 16),
        "depth": (5, 1, 16, 16),
        "normal": (5, 3, 16, 16),
    }
    again = scenes.render(np.random.default_rng([3, 0, 4]), 16)  # scene 4 of train, from its own stream
    assert torch.equal(batch["x"][4], torch.from_numpy(np.moveaxis(again.image, -1, 0)))
    # The same seed gives the same files; a larger count keeps the first scenes.
    more = scenes.write(tmp_path / "more", train=7, val=2, size=16, seed=3)
    assert (more / "train/depth/4.npy").read_bytes() == (out / "train/depth/4.npy").read_bytes()


def test_the_command_refuses_a_folder_with_files_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "kept.txt").write_text("a user's file")
    with pytest.raises(SystemExit):
        scenes.main([str(tmp_path), "--train", "2", "--val", "1", "--size", "8"])
    assert "exists and is not empty" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt"]
