"""Your images as the field stores them: a folder (class sub-folders give a label) or a zip with stylegan2-ada's
``dataset.json`` of labels, decoded one at a time as batches draw them (RAM does not grow with their number)."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import StackDataset

from multiloss.config import ConfigError, require
from multiloss.data.arrays import ArrayDataModule, check_like_training
from multiloss.data.columns import FileSamples, FileStore, LazyColumn

LABEL_SOURCES = ("auto", "json", "folders", "none")


def image_extensions() -> set[str]:
    """The file extensions PIL decodes (what stylegan2-ada's dataset lists: ``PIL.Image.EXTENSION``)."""
    from PIL import Image

    Image.init()
    return set(Image.EXTENSION)


@dataclass(frozen=True)
class ImageDecoder:
    """``bytes -> (H, W, C) uint8``: the image's own channels (1 grey, 2 grey+alpha, 3 RGB, 4 RGBA; other modes as
    RGB) or ``channels`` (1 or 3, converted); with ``resolution``, center-cropped to a square and resized with
    Lanczos to ``resolution``² when not that size already (stylegan2-ada's ``dataset_tool.py --transform=center-crop``).
    A class, not a closure: a loader worker started by spawn or forkserver receives it pickled.
    """

    channels: int | None = None
    resolution: int | None = None

    def __call__(self, data: bytes) -> np.ndarray:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as image:
            if self.channels is not None:
                image = image.convert("L" if self.channels == 1 else "RGB")
            elif image.mode not in ("L", "LA", "RGB", "RGBA"):
                image = image.convert("RGBA" if "transparency" in image.info or "A" in image.getbands() else "RGB")
            size = self.resolution
            if size is not None and image.size != (size, size):
                w, h = image.size
                crop = min(w, h)
                image = image.crop(((w - crop) // 2, (h - crop) // 2, (w + crop) // 2, (h + crop) // 2))
                image = image.resize((size, size), Image.LANCZOS)
            array = np.array(image)  # a copy torch may write to (np.asarray's view of PIL's buffer is read-only)
        return array[:, :, None] if array.ndim == 2 else array


@dataclass(frozen=True)
class ScaledImage:
    """``bytes -> (C, H, W)``: ``decode``'s uint8 mapped linearly from 0..255 onto ``value_range`` as float32
    (``[-1, 1]``: stylegan2-ada's ``x / 127.5 - 1``, to the bit), or uint8 as stored when ``value_range`` is None."""

    decode: ImageDecoder
    value_range: tuple[float, float] | None = (0.0, 1.0)

    def __call__(self, data: bytes) -> torch.Tensor:
        chw = torch.from_numpy(np.ascontiguousarray(self.decode(data).transpose(2, 0, 1)))
        if self.value_range is None:
            return chw
        low, high = self.value_range
        return chw.to(torch.float32) / (255 / (high - low)) + low


def as_range(value_range: Sequence[float] | None, key: str = "value_range") -> tuple[float, float] | None:
    """``value_range`` checked, as a pair of floats (None kept)."""
    require(
        value_range is None
        or (
            isinstance(value_range, Sequence)
            and len(value_range) == 2
            and all(isinstance(v, int | float) for v in value_range)
            and value_range[0] < value_range[1]
        ),
        key,
        value_range,
        "[low, high] with low < high: [0, 1], or [-1, 1] (stylegan2-ada's x/127.5 - 1); null keeps uint8 0..255",
    )
    return None if value_range is None else (float(value_range[0]), float(value_range[1]))


class ImagesDataModule(ArrayDataModule):
    """Images from ``path``, a folder or a ``.zip``: ``x`` each image channels-first, ``y`` its label if it has one.

    The images are the files PIL decodes (``.png``, ``.jpg``, ...), in sorted order of their path (as stylegan2-ada's
    dataset lists them); every one must decode to the first one's shape (same size and channels: ``resolution``
    and ``channels`` make them so). Labels (``labels``): ``json`` reads stylegan2-ada's ``dataset.json``
    (``{"labels": [[name, label], ...]}``: an integer class -> ``y`` int64, a list -> ``y`` float32 vector, null ->
    no ``y``); ``folders`` takes torchvision's ImageFolder layout, each image in a class sub-folder (the sorted
    folder names are classes 0, 1, ...); ``auto`` (default) is ``json`` when the root holds a ``dataset.json``,
    else ``folders`` when every image sits in a sub-folder, else none; ``none``. ``value_range`` maps 0..255 onto
    ``[low, high]`` (float32; null keeps uint8); ``xflip`` doubles the training set with every image mirrored
    left-right (stylegan2-ada's ``--mirror``: example i + n is example i flipped; validation and test never are);
    ``flatten`` serves ``x`` as ``(C·H·W,)`` for an MLP. ``val_path`` / ``test_path``: folders or zips of the same
    layout for validation and test (then no random split).

    Raises:
        ConfigError: a path that is neither a folder nor a zip, no images, a first image that does not decode, a
            ``dataset.json`` that does not parse or lacks an image's label, a label source the layout does not have,
            a validation folder with a class the training folder lacks; bad settings, named.
    """

    def __init__(
        self,
        path: str,
        val_path: str | None = None,
        test_path: str | None = None,
        labels: str = "auto",
        channels: int | None = None,
        resolution: int | None = None,
        value_range: Sequence[float] | None = (0.0, 1.0),
        xflip: bool = False,
        flatten: bool = False,
        val_fraction: float | None = None,
        **kwargs,
    ) -> None:
        for given, key in ((path, "path"), (val_path, "val_path"), (test_path, "test_path")):
            require(
                given is None
                or os.path.isdir(given)
                or (os.path.isfile(given) and str(given).lower().endswith(".zip")),
                key,
                str(given),
                "a folder of images or a .zip of them",
                "not a folder or a .zip" if given is not None and os.path.exists(given) else "no such folder",
            )
        fraction = (0.0 if val_path is not None else 0.2) if val_fraction is None else val_fraction
        super().__init__(val_fraction=fraction, **kwargs)
        self.given_parts(val_path, test_path)
        require(labels in LABEL_SOURCES, "labels", labels, " | ".join(LABEL_SOURCES))
        require(channels in (None, 1, 3), "channels", channels, "1 (grey), 3 (RGB), or null (as stored)")
        require(
            resolution is None or (isinstance(resolution, int) and resolution >= 1),
            "resolution",
            resolution,
            "an integer ≥ 1 (center-crop and resize to resolution²), or null (as stored)",
        )
        require(isinstance(xflip, bool), "xflip", xflip, "true or false")
        self.xflip = xflip
        self.decode = ScaledImage(ImageDecoder(channels, resolution), as_range(value_range))
        self.value_range = as_range(value_range)  # what the images' values span (the sample plots read it)
        self.flatten, self.label_source = flatten, labels
        self.classes: list[str] | None = None
        given = {"train": (path, "path"), "val": (val_path, "val_path"), "test": (test_path, "test_path")}
        self.parts = {part: self._read(Path(p), key) for part, (p, key) in given.items() if p is not None}
        for part in ("val", "test"):
            if part in self.parts:
                path, key = given[part]
                check_like_training(self.parts[part], self.parts["train"], key, str(path))

    def _read(self, path: Path, key: str) -> dict[str, torch.Tensor | LazyColumn]:
        """One part's images and labels (its path checked in ``__init__``)."""
        store = FileStore(path)
        try:
            names = store.names()
        except Exception as err:  # a damaged zip
            raise ConfigError(key, str(path), "a readable .zip", f"cannot read it: {err}") from None
        extensions = image_extensions()
        images = [n for n in names if Path(n).suffix.lower() in extensions]
        require(
            len(images) > 0,
            key,
            str(path),
            "a folder or zip holding images (files PIL decodes: .png, .jpg, ...)",
            f"no images among its {len(names)} files",
        )
        x = FileSamples(store, images, self.decode, "x", key)
        arrays: dict[str, torch.Tensor | LazyColumn] = {"x": x.flattened() if self.flatten else x}
        y = self._labels(store, names, images, key)
        if y is not None:
            arrays["y"] = y
        return arrays

    def _labels(self, store: FileStore, names: list[str], images: list[str], key: str) -> torch.Tensor | None:
        source = self.label_source
        in_folders = all("/" in n for n in images)
        if source == "auto":
            source = "json" if "dataset.json" in names else "folders" if in_folders else "none"
        if source == "none":
            return None
        if source == "json":
            require("dataset.json" in names, "labels", "json", "a dataset.json at the root of data.path (or auto)")
            try:
                spec = json.loads(store.read("dataset.json"))["labels"]
            except Exception as err:
                raise ConfigError(
                    key,
                    store.where("dataset.json"),
                    'a dataset.json of stylegan2-ada\'s form: {"labels": [["00000/img00000000.png", 6], ...]} or '
                    '{"labels": null}',
                    f"cannot read it: {type(err).__name__}: {err}",
                ) from None
            if spec is None:
                return None
            by_name = {str(name): label for name, label in spec}
            missing = [n for n in images if n not in by_name]
            require(
                not missing,
                key,
                store.where("dataset.json"),
                "a label for every image",
                f"{len(missing)} image(s) have none, the first {missing[0] if missing else ''!r}",
            )
            values = [by_name[n] for n in images]
            if all(isinstance(v, int) for v in values):
                return torch.tensor(values, dtype=torch.int64)
            return torch.tensor(np.asarray(values, dtype=np.float32))
        loose = next((n for n in images if "/" not in n), None)
        require(
            loose is None,
            "labels",
            "folders",
            "every image in a class sub-folder (root/<class>/<image>), as torchvision's ImageFolder reads them",
            f"{store.where(loose or '')} is not in one",
        )
        classes = sorted({n.split("/", 1)[0] for n in images})
        if self.classes is None:
            self.classes = classes
        unknown = sorted(set(classes) - set(self.classes))
        require(
            not unknown,
            key,
            str(store.path),
            f"class folders among the training data's: {self.classes}",
            f"it has {unknown}",
        )
        ids = {c: i for i, c in enumerate(self.classes)}
        return torch.tensor([ids[n.split("/", 1)[0]] for n in images], dtype=torch.int64)

    def load_parts(self) -> dict[str, dict[str, torch.Tensor | LazyColumn]]:
        return self.parts

    def training_examples(self, train: StackDataset) -> StackDataset:
        if not self.xflip:
            return train
        return StackDataset(
            **{k: v.mirrored() if isinstance(v, LazyColumn) else torch.cat([v, v]) for k, v in train.datasets.items()}
        )
