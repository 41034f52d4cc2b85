"""The shipped digits written in each layout the data group reads, to try a layout (or check a loader) offline.

    python -m multiloss.data.export images  OUT.zip   # stylegan2-ada's zip: img00000.png ..., dataset.json labels
    python -m multiloss.data.export classes OUT       # torchvision's ImageFolder: OUT/<class>/<i>.png
    python -m multiloss.data.export samples OUT       # per-sample files: OUT/{x,y,parity,ink}/<i>.npy
    python -m multiloss.data.export npy     OUT       # OUT/x.npy and OUT/y.npy, read lazily by data=npz

Images hold the digits' 0..16 levels × 15 (0..240), so ``data.value_range=[0,1.0625]`` gives back the digits'
``x / 16`` to the bit; the per-sample files and the ``.npy`` hold ``data=digits``' own tensors. In the order of
``data=digits``, the same split and the same batches follow: a run on any of them equals ``data=digits``.
"""

from __future__ import annotations

import argparse
import io
import json
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

LAYOUTS = ("images", "classes", "samples", "npy")


def png_bytes(image: np.ndarray, compress_level: int = 6) -> bytes:
    """A ``(H, W)`` or ``(H, W, C)`` uint8 array as PNG bytes (zlib's ``compress_level``, 0-9: PIL's default 6)."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG", compress_level=compress_level)
    return out.getvalue()


def write_image_zip(path: Path, images: np.ndarray, labels: np.ndarray | None = None) -> Path:
    """``images`` (N, H, W[, C]) uint8 as stylegan2-ada's ``dataset_tool.py`` writes a zip: ``img%08d.png`` in
    folders of 1000 and a ``dataset.json`` of ``labels`` (null without)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [f"{i // 1000:05d}/img{i:08d}.png" for i in range(len(images))]
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        for name, image in zip(names, images, strict=True):
            archive.writestr(name, png_bytes(image))
        listed = None if labels is None else [[n, int(c)] for n, c in zip(names, labels, strict=True)]
        archive.writestr("dataset.json", json.dumps({"labels": listed}))
    return path


def write_image_classes(root: Path, images: np.ndarray, labels: np.ndarray) -> Path:
    """``images`` in torchvision's ImageFolder layout: ``root/<label>/<i>.png``."""
    for i, (image, label) in enumerate(zip(images, labels, strict=True)):
        folder = root / str(int(label))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:05d}.png").write_bytes(png_bytes(image))
    return root


def write_samples(root: Path, arrays: Mapping[str, np.ndarray]) -> Path:
    """One ``.npy`` per sample and batch key: ``root/<key>/<i>.npy`` (LibMTL's layout under one part)."""
    for key, values in arrays.items():
        (root / key).mkdir(parents=True, exist_ok=True)
        for i, value in enumerate(values):
            np.save(root / key / f"{i}.npy", value)
    return root


def digits() -> dict[str, np.ndarray]:
    """``data=digits``' tensors (x, y, parity, ink) as arrays, in its order."""
    from multiloss.data.digits import DigitsDataModule

    return {k: v.numpy() for k, v in DigitsDataModule().load().items()}


def digit_images() -> np.ndarray:
    """The digits as (1797, 8, 8) uint8 images, levels 0..16 × 15."""
    return (np.rint(digits()["x"] * 16).astype(np.uint8) * 15).reshape(-1, 8, 8)


def export(layout: str, out: Path) -> Path:
    arrays = digits()
    if layout == "images":
        return write_image_zip(out, digit_images(), arrays["y"])
    if layout == "classes":
        return write_image_classes(out, digit_images(), arrays["y"])
    if layout == "samples":
        return write_samples(out, arrays)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "x.npy", arrays["x"])
    np.save(out / "y.npy", arrays["y"])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m multiloss.data.export", description=__doc__.split("\n")[0])
    parser.add_argument("layout", choices=LAYOUTS)
    parser.add_argument("out", type=Path, help="the zip (images) or folder to write; must not exist")
    args = parser.parse_args(argv)
    if args.out.exists():
        parser.error(f"{args.out} exists: name a new path (nothing is overwritten)")
    print(f"wrote {export(args.layout, args.out)}")


if __name__ == "__main__":
    main()
