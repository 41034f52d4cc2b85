"""Data as users keep it: image folders and zips, per-sample files, lazily read arrays.

The proofs train on the shipped digits written in each layout (`multiloss.data.export`) and compare with
``data=digits``: the same examples, split and batches give the same weights to the bit. Then what a loader must
keep — workers and an exact mid-epoch resume, 2 ranks × b = 1 rank × 2b (in float64, to `EXACT`) — and bad data,
named, before training where a listing finds it, else at the batch that meets it with the checkpoints kept.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from multiloss import train
from multiloss.config import ConfigError
from multiloss.data import BadSample, ImagesDataModule, NpzDataModule, SamplesDataModule
from multiloss.data.export import digit_images, export, png_bytes, write_image_zip, write_samples
from tests.conftest import QUIET, load_weights, run_cli, train_here
from tests.helpers import straight_and_resumed
from tests.rank_pool import pooled_train

RUN = ("~callbacks.loss_curves", "trainer=cpu", "trainer.num_sanity_val_steps=0")
QUIET_RUN = (*QUIET, *RUN)
# The digits' levels back to x / 16 from images that hold them × 15: 0..255 onto [0, 255/240].
AS_DIGITS = ("data.channels=1", "data.value_range=[0,1.0625]", "data.flatten=true")
F64 = "trainer.precision=64-true"  # the proofs' runs: module and batches in float64
EXACT = 1e-10  # float64: equal up to rounding (four steps' stays near 1e-15), on any CPU


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    return {
        layout: export(layout, root / (f"{layout}.zip" if layout == "images" else layout))
        for layout in ("images", "classes", "samples", "npy")
    }


def assert_same_weights(a: Path, b: Path, atol: float = 0.0) -> None:
    """Two runs' last weights: the same to ``atol`` (0: to the bit)."""
    wa, wb = load_weights(a / "checkpoints/last.ckpt"), load_weights(b / "checkpoints/last.ckpt")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=atol, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def data_of(layout: str, layouts: dict[str, Path]) -> tuple[str, ...]:
    """The overrides reading the exported digits in ``layout`` as ``data=digits`` serves them."""
    path = layouts[layout]
    if layout in ("images", "classes"):  # a zip with stylegan2-ada's dataset.json; class folders
        return ("data=images", f"data.path={path}", *AS_DIGITS)
    if layout == "samples":
        return ("data=samples", f"data.path={path}")
    return ("data=npz", f"data.path={path / 'x.npy'}", f"data.y_path={path / 'y.npy'}")


def test_every_layout_serves_the_digits_to_the_bit(layouts):
    reference = _ready_digits()
    for layout in ("images", "samples", "npy"):
        dm = {
            "images": lambda: ImagesDataModule(
                str(layouts["images"]), channels=1, value_range=[0, 1.0625], flatten=True
            ),
            "samples": lambda: SamplesDataModule(str(layouts["samples"])),
            "npy": lambda: NpzDataModule(str(layouts["npy"] / "x.npy"), y_path=str(layouts["npy"] / "y.npy")),
        }[layout]()
        dm.setup("fit")
        for part in ("train_set", "val_set"):
            ours, theirs = getattr(dm, part), getattr(reference, part)
            assert len(ours) == len(theirs)
            rows = [0, 5, len(ours) - 1]
            # Pickled as a worker started by spawn or forkserver receives it (open files are not carried).
            for served in (ours, pickle.loads(pickle.dumps(ours))):
                for key in served.datasets:
                    got = torch.stack([served[i][key] for i in rows])
                    assert torch.equal(got, theirs.datasets[key][rows]), (layout, part, key)


def _ready_digits():
    from multiloss.data import DigitsDataModule

    dm = DigitsDataModule()
    dm.setup("fit")
    return dm


@pytest.mark.parametrize(
    ("recipe", "layout"), [("accumulation", "images"), ("weighted", "samples"), ("accumulation", "npy")]
)
def test_a_run_on_a_layout_equals_the_run_on_data_digits(tmp_path, layouts, recipe, layout):
    common = (
        *QUIET_RUN,
        f"recipe={recipe}",
        "data.batch_size=64",
        "trainer.max_steps=8",
        "trainer.val_check_interval=4",
    )
    ours = train_here(tmp_path / layout, *common, *data_of(layout, layouts), "data.num_workers=1")
    theirs = train_here(tmp_path / "digits", *common, "data=digits")
    assert_same_weights(ours, theirs)


@pytest.mark.parametrize("layout", ["images", "samples", "npy"])
def test_two_workers_resume_mid_epoch_exactly(make_cfg, tmp_path, layouts, layout):
    extra = ("data.xflip=true",) if layout == "images" else ()  # the mirrored half is drawn too
    common = (
        *RUN,  # make_cfg adds QUIET
        "recipe=accumulation",
        *data_of(layout, layouts),
        *extra,
        "data.num_workers=2",
        "data.batch_size=128",
        "trainer.val_check_interval=5",
    )
    # 7 steps: mid-epoch 0 (11 or 22 batches an epoch; k=2 micro-batches a step).
    straight, _, resumed = straight_and_resumed(
        make_cfg, tmp_path, common, "trainer.max_steps=3", "trainer.max_steps=7"
    )
    assert_same_weights(straight, resumed)


@pytest.mark.parametrize("layout", ["images", "classes", "samples", "npy"])
def test_every_layout_continues_mid_epoch_on_another_batch_size(make_cfg, tmp_path, layouts, layout):
    """Each layout's training loader keeps its place in examples (a zip's mirrored images counted too): stopped at
    step 3 of 64 with 2 workers, continued at 96 a batch, the epoch ends after exactly the examples left.
    (tests/test_elastic_resume.py proves by id that they are the ones left, once.)"""
    extra = ("data.xflip=true",) if layout == "images" else ()
    common = (*RUN, "recipe=accumulation", "model.accumulate_grad_batches=1", *data_of(layout, layouts), *extra)
    common = (*common, "data.num_workers=2", "trainer.max_epochs=1")
    run = tmp_path / "run"
    train(make_cfg(*common, "data.batch_size=64", "trainer.max_steps=3", output_dir=run))
    loops = torch.load(run / "checkpoints/last.ckpt", weights_only=True)["loops"]["fit_loop"]
    position = loops["state_dict"]["combined_loader"][0]["position"]
    assert position["consumed"] == 3 * 64 and position["examples"] == (2 if extra else 1) * 1438
    train(make_cfg(*common, "data.batch_size=96", "trainer.max_steps=-1", "ckpt_path=last", output_dir=run))
    steps = 3 + -(-(position["examples"] - 3 * 64) // 96)
    assert torch.load(run / "checkpoints/last.ckpt", weights_only=True)["global_step"] == steps


def test_image_options_are_stylegan2_adas(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(6, 12, 16, 3), dtype=np.uint8)
    zipped = write_image_zip(tmp_path / "rgb.zip", images)
    dm = ImagesDataModule(str(zipped), value_range=[-1, 1], xflip=True, val_fraction=0)
    dm.setup("fit")
    assert "y" not in dm.train_set.datasets  # labels: null
    assert len(dm.train_set) == 12  # doubled
    chw = torch.from_numpy(images).permute(0, 3, 1, 2)[dm.train_index[0]]
    assert torch.equal(dm.train_set[0]["x"], chw.to(torch.float32) / 127.5 - 1)  # training_loop.py's scaling
    assert torch.equal(dm.train_set[6]["x"], dm.train_set[0]["x"].flip(-1))  # example i + n: i mirrored
    grey = ImagesDataModule(str(zipped), channels=1, resolution=8, value_range=None, val_fraction=0)
    grey.setup("fit")
    x = grey.train_set[0]["x"]
    assert x.shape == (1, 8, 8) and x.dtype == torch.uint8  # center-cropped 12×12, resized; uint8 kept


def test_class_folders_are_labels_in_sorted_order(tmp_path):
    for cls in ("cat", "dog", "emu"):
        (tmp_path / "train" / cls).mkdir(parents=True)
        (tmp_path / "train" / cls / "a.png").write_bytes(png_bytes(np.full((4, 4), 9, np.uint8)))
    (tmp_path / "val" / "dog").mkdir(parents=True)
    (tmp_path / "val" / "dog" / "b.png").write_bytes(png_bytes(np.zeros((4, 4), np.uint8)))
    dm = ImagesDataModule(str(tmp_path / "train"), val_path=str(tmp_path / "val"))
    dm.setup("fit")
    assert dm.classes == ["cat", "dog", "emu"]
    assert dm.train_set.datasets["y"].tolist() == [0, 1, 2] and dm.val_set.datasets["y"].tolist() == [1]
    (tmp_path / "val" / "fox").mkdir()
    (tmp_path / "val" / "fox" / "c.png").write_bytes(png_bytes(np.zeros((4, 4), np.uint8)))
    with pytest.raises(ConfigError, match=r"it has \['fox'\]") as err:
        ImagesDataModule(str(tmp_path / "train"), val_path=str(tmp_path / "val"))
    assert err.value.key == "val_path"


def test_libmtl_nyuv2_layout_reads_as_is(tmp_path):
    """LibMTL's examples/nyu: {train,val}/{image,label,depth,normal}/<i>.npy, (H, W, C) images and maps."""
    rng = np.random.default_rng(0)
    for part, n in (("train", 12), ("val", 4)):
        write_samples(
            tmp_path / "nyuv2" / part,
            {
                "image": rng.random((n, 6, 8, 3), dtype=np.float32),
                "label": rng.integers(-1, 13, (n, 6, 8)).astype(np.float32),  # LibMTL stores them as floats
                "depth": rng.random((n, 6, 8, 1), dtype=np.float32),
                "normal": rng.random((n, 6, 8, 3), dtype=np.float32),
            },
        )
    dm = SamplesDataModule(
        str(tmp_path / "nyuv2"), channels_last=["x", "depth", "normal"], dtypes={"label": "int64"}, batch_size=4
    )
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (12, 4)
    batch = next(iter(dm.train_dataloader()))
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in batch.items()}
    assert shapes == {
        "x": ((4, 3, 6, 8), torch.float32),
        "label": ((4, 6, 8), torch.int64),
        "depth": ((4, 1, 6, 8), torch.float32),
        "normal": ((4, 3, 6, 8), torch.float32),
    }
    first = np.load(tmp_path / "nyuv2/val/image/0.npy")
    assert torch.equal(dm.val_set[0]["x"], torch.from_numpy(np.moveaxis(first, -1, 0)))  # LibMTL's moveaxis
    # Samples in number order: 10.npy after 9.npy, as LibMTL reads range(n).
    assert dm.parts["train"]["x"].names[:3] == ["0.npy", "1.npy", "2.npy"]
    assert dm.parts["train"]["x"].names[10] == "10.npy"


def test_ram_does_not_hold_a_lazy_array(tmp_path):
    np.save(tmp_path / "big.npy", np.arange(40 * 1000, dtype=np.float32).reshape(40, 1000))
    dm = NpzDataModule(str(tmp_path / "big.npy"), batch_size=8)
    dm.setup("fit")
    column = dm.train_set.datasets["x"]
    assert type(column).__name__ == "NpyRows" and column.rows is not None  # a view of row numbers, no copy
    row = int(column.rows[0])
    assert torch.equal(dm.train_set[0]["x"], torch.arange(row * 1000, row * 1000 + 1000, dtype=torch.float32))
    np.savez(tmp_path / "stored.npz", x=np.zeros((4, 2)), y=np.arange(4))
    lazy = NpzDataModule(str(tmp_path / "stored.npz"), lazy=True)
    assert type(lazy.arrays["x"]).__name__ == "NpyRows" and lazy.arrays["y"][3].item() == 3


# --- bad data: named before training where a listing finds it ----------------------------------------------------


def _bad_zip_without_a_label(tmp_path: Path) -> dict:
    path = write_image_zip(tmp_path / "a.zip", digit_images()[:3], np.arange(3))
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if n.endswith(".png")]
        files = {n: z.read(n) for n in names}
    with zipfile.ZipFile(path, "w") as z:
        for n, data in files.items():
            z.writestr(n, data)
        z.writestr("dataset.json", json.dumps({"labels": [[names[0], 1]]}))
    return {"path": str(path)}


def _undecodable_first(tmp_path: Path) -> dict:
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(b"not a png")
    return {"path": str(tmp_path / "imgs")}


def _no_images(tmp_path: Path) -> dict:
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "notes.txt").write_text("hello")
    return {"path": str(tmp_path / "imgs")}


@pytest.mark.parametrize(
    ("make", "key", "said"),
    [
        (lambda tmp: {"path": str(tmp / "nowhere")}, "path", "no such folder"),
        (_no_images, "path", "no images among its 1 files"),
        (_undecodable_first, "path", "it does not"),
        (_bad_zip_without_a_label, "path", "2 image\\(s\\) have none"),
        (lambda tmp: {"path": str(tmp), "channels": 2}, "channels", None),
        (lambda tmp: {"path": str(tmp), "value_range": [1, 0]}, "value_range", None),
        (lambda tmp: {"path": str(tmp), "labels": "tags"}, "labels", None),
    ],
)
def test_images_refuse_bad_data_by_name(tmp_path, make, key, said):
    with pytest.raises(ConfigError, match=said) as err:
        ImagesDataModule(**make(tmp_path))
    assert err.value.key == key


def test_samples_name_the_missing_file_and_mixed_kinds(tmp_path):
    write_samples(tmp_path / "s", {"x": np.zeros((4, 3), np.float32), "y": np.arange(4)})
    (tmp_path / "s" / "y" / "2.npy").unlink()
    with pytest.raises(ConfigError, match=r"1 sample\(s\) have no file here, the first \['2'\] \(found in x/\)") as e:
        SamplesDataModule(str(tmp_path / "s"))
    assert e.value.key == "path" and e.value.value.endswith("/y")
    np.save(tmp_path / "s" / "y" / "2.npy", 2)
    (tmp_path / "s" / "y" / "3.npy").rename(tmp_path / "s" / "y" / "3.pt")
    with pytest.raises(ConfigError, match=r"it holds \['.npy', '.pt'\]"):
        SamplesDataModule(str(tmp_path / "s"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no sub-folders"):
        SamplesDataModule(str(tmp_path / "empty"))


def test_lazy_arrays_refuse_what_cannot_be_read_a_row_at_a_time(tmp_path):
    np.savez_compressed(tmp_path / "packed.npz", x=np.zeros((4, 2)))
    with pytest.raises(ConfigError, match="compressed") as err:
        NpzDataModule(str(tmp_path / "packed.npz"), lazy=True)
    assert err.value.key == "path"
    np.save(tmp_path / "cut.npy", np.zeros((100, 10)))
    data = (tmp_path / "cut.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(data[:-80])
    with pytest.raises(ConfigError, match="truncated"):
        NpzDataModule(str(tmp_path / "cut.npy"))


# --- bad data: met by a batch, the run stops naming the file; the checkpoint before it is kept -------------------


@pytest.mark.parametrize(
    "damage",
    ["undecodable", "another size", "nan row"],
)
def test_bad_data_met_mid_run_stops_it_with_one_message_and_the_checkpoint_kept(tmp_path, damage):
    data: tuple[str, ...]
    if damage == "nan row":
        x = np.random.default_rng(0).random((64, 64), dtype=np.float32)
        np.save(tmp_path / "x.npy", x)
        np.save(tmp_path / "y.npy", np.arange(64) % 10)
        data = ("data=npz", f"data.path={tmp_path / 'x.npy'}", f"data.y_path={tmp_path / 'y.npy'}")
    else:
        folder = tmp_path / "digits"
        for i, image in enumerate(digit_images()[:64]):
            (folder / str(i % 10)).mkdir(parents=True, exist_ok=True)
            (folder / str(i % 10) / f"{i:03d}.png").write_bytes(png_bytes(image))
        data = ("data=images", f"data.path={folder}", *AS_DIGITS)
    common = (*data, "recipe=accumulation", "data.batch_size=8", "data.num_workers=1", "trainer.max_steps=2")
    run = tmp_path / "run"
    first = run_cli(*QUIET_RUN, *common, f"hydra.run.dir={run}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = run / "checkpoints/last.ckpt"
    saved = ckpt.read_bytes()
    if damage == "nan row":
        x[40, 3] = np.nan
        np.save(tmp_path / "x.npy", x)
        bad = f"{tmp_path / 'x.npy'} row 40"
    else:
        bad_file = tmp_path / "digits/3/013.png"
        size = (8, 8) if damage == "undecodable" else (9, 8)
        bad_file.write_bytes(b"garbage" if damage == "undecodable" else png_bytes(np.zeros(size, np.uint8)))
        bad = str(bad_file)
    proc = run_cli(
        *QUIET_RUN,
        *common,
        f"ckpt_path={ckpt}",
        "trainer.max_steps=40",
        f"hydra.run.dir={tmp_path / 'on'}",
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("multiloss:")]
    assert len(lines) == 1 and "run stopped: data: " + bad in lines[0], proc.stderr[-3000:]
    said = {"undecodable": "does not decode", "another size": "it is (1, 9, 8)", "nan row": "1 NaN/inf values"}[damage]
    assert said in proc.stderr
    assert ckpt.read_bytes() == saved  # the run it continued from is untouched


def test_bad_sample_survives_a_loader_worker():
    """A DataLoader worker re-raises an exception in the main process as ``type(message)``."""
    from multiloss.data.columns import worker_message

    err = BadSample(
        "Caught BadSample in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
        "  File \"x\"\nmultiloss.data.columns.BadSample: data: /a/b.png (batch key 'x'): it is (9,)"
    )
    assert worker_message(err) == "data: /a/b.png (batch key 'x'): it is (9,)"


@pytest.mark.parametrize(
    ("recipe", "layout", "test_split", "metric"),
    [
        ("accumulation", "images", "data.test_path={classes}", "acc"),  # a test folder of another layout
        ("weighted", "samples", "data.test_fraction=0.2", "acc/digit"),
        ("accumulation", "npy", "data.test_fraction=0.2", "acc"),
    ],
)
def test_multiloss_eval_scores_a_layouts_validation_and_test_sets(
    tmp_path, layouts, recipe, layout, test_split, metric
):
    from multiloss import train
    from multiloss.evaluation import evaluate, with_training_overrides
    from multiloss.testing import compose

    split = test_split.format(classes=layouts["classes"])
    trained = train(
        compose(
            *QUIET_RUN,
            f"recipe={recipe}",
            *data_of(layout, layouts),
            split,
            "trainer.max_epochs=1",
            "trainer.max_steps=-1",
            "trainer.limit_train_batches=6",
            F64,
            output_dir=tmp_path / "train",
        )
    )
    ckpt = tmp_path / "train/checkpoints/last.ckpt"
    cfg = compose(
        *with_training_overrides([f"ckpt_path={ckpt}", *QUIET]), config_name="eval", output_dir=tmp_path / "e"
    )
    assert cfg.trainer.precision == "64-true"  # from the run's overrides
    metrics = evaluate(cfg)
    # The run's last validation again, bit for bit: the same float64 weights, data and arithmetic, in one process.
    assert metrics[f"val/{metric}"] == trained[f"val/{metric}"]
    assert f"test/{metric}" in metrics


# --- DDP --------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("layout", "trainer"), [("images", "ddp_cpu"), ("samples", "ddp_cpu"), ("npy", "fsdp_cpu")])
def test_two_ranks_equal_one_rank_with_twice_the_batch(tmp_path, layouts, layout, trainer):
    recipe = "weighted" if layout == "samples" else "accumulation"
    common = (
        f"recipe={recipe}",
        "optimizer=sgd",
        *data_of(layout, layouts),
        "data.shuffle=false",
        "trainer.max_steps=4",
        "trainer.val_check_interval=4",
        F64,  # FSDP2 too (its DoublePrecision as a plugin, src/multiloss/training.py)
    )
    quiet = (*QUIET, "~callbacks.loss_curves")
    two = pooled_train(tmp_path / "two", *quiet, *common, f"trainer={trainer}", "data.batch_size=16", cwd=tmp_path)
    one = train_here(tmp_path / "one", *quiet, *common, "trainer=cpu", "data.batch_size=32")
    assert {w.dtype for w in load_weights(one / "checkpoints/last.ckpt").values()} == {torch.float64}
    assert_same_weights(two, one, atol=EXACT)


def test_the_docs_layout_lines_run_as_written(tmp_path):
    """docs/data.md's block: each layout exported, then each launch line trains on it (2 steps, quietly)."""
    from tests.conftest import ROOT, run_shell
    from tests.test_docs import FENCE

    block = next(m.group(2) for m in FENCE.finditer((ROOT / "docs/data.md").read_text()) if m.group(1) == "bash")
    lines = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    assert sum(" -m multiloss.data.export " in line for line in lines) == 4 and len(lines) == 8
    short = " ".join([*QUIET_RUN, "trainer.max_steps=2", "trainer.limit_val_batches=1", "model.n_plot_samples=0"])
    for line in lines:
        if line.startswith("python train.py"):
            line = (
                f"{line.replace('train.py', str(ROOT / 'train.py'), 1)} {short} hydra.run.dir=run_{lines.index(line)}"
            )
            if "recipe=gan" not in line:
                line = line.replace(" model.n_plot_samples=0", "")
        proc = run_shell(line, cwd=tmp_path)
        assert proc.returncode == 0, (line, proc.stderr[-3000:])
