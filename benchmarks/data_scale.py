"""Data at its real size: peak memory flat in the data's size, and a loader that keeps a conv net's step fed.

    python benchmarks/data_scale.py generate DIR [--gib 4]   # ≥ 4 GiB of each layout (and a 1/16 subset of each)
    python benchmarks/data_scale.py memory DIR               # one epoch on each, full and 1/16: peak RSS
    python benchmarks/data_scale.py loader DIR               # conv net step: the real loader vs in-memory tensors

``generate`` writes, from a seed, random-noise data that does not compress (so its size on disk is its size):
``images/`` (256×256 RGB PNGs in stylegan2-ada's 00000/ folders of 1000, with a dataset.json of 10 classes),
``images.zip`` (the same files, stored), ``samples/{x,y}/<i>.npy`` (x float32 (3, 128, 128)), ``rows/{x,y}.npy``
(x float32 (N, 12288)), each ≥ ``--gib``; ``*_16`` beside each is its first 1/16 (the folders by symbolic link).

``memory`` runs ``python train.py recipe=accumulation`` (an MLP on the flattened examples, its 12,288 or 49,152
inputs; ``data.num_workers=2``) on each layout for one epoch and on its 1/16 for 16 (the same steps: glibc's heap
grows with the number of batches allocated and freed, whatever the data's size), polling every process of the run
(the main one and its loader workers): each one's own peak resident memory (the kernel's VmHWM, exact) and
their sum sampled every 0.1 s; prints each peak and the
difference (the issue's bound: within 300 MiB). ``loader`` trains a 4-layer conv net on 3×64×64 images
(batch 64, SGD), 40 steps on batches from ``data=images`` (2 workers, a folder of 64×64 PNGs) and 40 steps
on the same batches held in memory, interleaved in blocks of 10, and prints the median step times and their
ratio (the issue's bound: ≤ 1.1). A benchmark, not a test: the numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

GIB, MIB = 1 << 30, 1 << 20


def _png(image: np.ndarray) -> bytes:
    from multiloss.data.export import png_bytes

    return png_bytes(image, compress_level=1)  # noise does not compress: level 6 only takes 10× longer


def generate(out: Path, gib: float) -> None:
    import zipfile

    rng = np.random.default_rng(0)
    target = int(gib * GIB)
    out.mkdir(parents=True, exist_ok=True)
    # Images: one PNG of noise ~197 KB; a folder and a stored zip of the same files.
    folder, written, names = out / "images", 0, []
    if not folder.exists():
        folder.mkdir()
        while written < target:
            name = f"{len(names) // 1000:05d}/img{len(names):08d}.png"
            (folder / name).parent.mkdir(exist_ok=True)
            data = _png(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8))
            (folder / name).write_bytes(data)
            written += len(data)
            names.append(name)
        labels = [[n, i % 10] for i, n in enumerate(names)]
        (folder / "dataset.json").write_text(json.dumps({"labels": labels}))
        print(f"images: {len(names)} PNGs, {written / GIB:.2f} GiB", flush=True)
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*.png"))
    labels = json.loads((folder / "dataset.json").read_text())["labels"]
    subset = folder.with_name("images_16")
    if not subset.exists():
        for name in names[: len(names) // 16]:
            (subset / name).parent.mkdir(parents=True, exist_ok=True)
            (subset / name).symlink_to(folder / name)
        (subset / "dataset.json").write_text(json.dumps({"labels": labels[: len(names) // 16]}))
    for zipped, listed in ((out / "images.zip", names), (out / "images_16.zip", names[: len(names) // 16])):
        if not zipped.exists():
            with zipfile.ZipFile(zipped, "w", compression=zipfile.ZIP_STORED) as archive:
                for name in listed:
                    archive.write(folder / name, name)
                archive.writestr("dataset.json", json.dumps({"labels": labels[: len(listed)]}))
            print(f"{zipped.name}: {zipped.stat().st_size / GIB:.2f} GiB", flush=True)
    # Per-sample files: x (3, 128, 128) float32 (192 KiB) and y per sample.
    samples = out / "samples"
    per = 3 * 128 * 128 * 4
    n = -(-target // per)
    if not samples.exists():
        for key in ("x", "y"):
            (samples / key).mkdir(parents=True)
        for i in range(n):
            np.save(samples / "x" / f"{i}.npy", rng.random((3, 128, 128), dtype=np.float32))
            np.save(samples / "y" / f"{i}.npy", np.int64(i % 10))
        print(f"samples: {n} samples, {n * per / GIB:.2f} GiB of x", flush=True)
    subset = out / "samples_16"
    if not subset.exists():
        for key in ("x", "y"):
            (subset / key).mkdir(parents=True)
            for i in range(n // 16):
                (subset / key / f"{i}.npy").symlink_to(samples / key / f"{i}.npy")
    # Rows of one .npy: (N, 12288) float32, written a chunk at a time (never held whole).
    rows = out / "rows"
    width = 3 * 64 * 64
    n_rows = -(-target // (width * 4))
    if not rows.exists():
        rows.mkdir()
        for path, count in ((rows / "x.npy", n_rows), (out / "rows_16" / "x.npy", n_rows // 16)):
            path.parent.mkdir(exist_ok=True)
            array = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(count, width))
            for start in range(0, count, 4096):
                stop = min(count, start + 4096)
                array[start:stop] = rng.random((stop - start, width), dtype=np.float32)
            array.flush()
            del array
            np.save(path.with_name("y.npy"), np.arange(count) % 10)
        print(f"rows: {n_rows} × {width} float32, {n_rows * width * 4 / GIB:.2f} GiB", flush=True)


def _tree_peaks(pid: int, peaks: dict[int, int]) -> int:
    """Each process's own peak resident memory so far (the kernel's VmHWM, exact, not sampled), for ``pid`` and every
    process below it, into ``peaks``; returns the processes' summed current RSS."""
    now, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{p}/status").read_text().splitlines())
            peaks[p] = max(peaks.get(p, 0), int(fields["VmHWM"].split()[0]) * 1024)
            now += int(fields["VmRSS"].split()[0]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, KeyError):
            continue
    return now


def _peak_memory_of(command: list[str], cwd: Path) -> tuple[dict[str, int], float, int]:
    """Run ``command``; the peak resident memory of its main process, of its largest loader worker, and of all its
    processes together (sampled every 0.1 s), in bytes; its wall time (s) and exit code."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, int] = {}
    together, done = 0, threading.Event()

    def poll() -> None:
        nonlocal together
        while not done.is_set():
            together = max(together, _tree_peaks(proc.pid, peaks))
            time.sleep(0.1)

    watcher = threading.Thread(target=poll)
    watcher.start()
    _, err = proc.communicate()
    done.set()
    watcher.join()
    if proc.returncode:
        print(err[-3000:], file=sys.stderr)
    workers = [v for p, v in peaks.items() if p != proc.pid]
    found = {"main": peaks.get(proc.pid, 0), "worker": max(workers, default=0), "together": together}
    return found, time.perf_counter() - start, proc.returncode


def memory(root: Path) -> None:
    runs = {
        "image folder": ("data=images", "data.resolution=64", "data.flatten=true", "model.net.in_features=12288"),
        "image zip": ("data=images", "data.resolution=64", "data.flatten=true", "model.net.in_features=12288"),
        "per-sample .npy": ("data=samples", "data.flatten=[x]", "model.net.in_features=49152", "data.batch_size=64"),
        "lazy .npy rows": ("data=npz", "model.net.in_features=12288"),
    }
    paths = {
        "image folder": ("data.path={}/images",),
        "image zip": ("data.path={}/images.zip",),
        "per-sample .npy": ("data.path={}/samples",),
        "lazy .npy rows": ("data.path={}/rows/x.npy", "data.y_path={}/rows/y.npy"),
    }
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}"
    )
    for name, overrides in runs.items():
        peaks = {}
        for suffix in ("", "_16"):
            given = [
                p.format(root).replace("/images", f"/images{suffix}", 1) if "images" in p else p.format(root)
                for p in paths[name]
            ]
            given = [g.replace("/samples", f"/samples{suffix}").replace("/rows/", f"/rows{suffix}/") for g in given]
            run_dir = root / "runs" / f"{name.replace(' ', '_')}{suffix}-{time.strftime('%Y%m%d-%H%M%S')}"
            command = [
                sys.executable,
                str(ROOT / "train.py"),
                "recipe=accumulation",
                *overrides,
                *given,
                "data.num_workers=2",
                f"trainer.max_epochs={16 if suffix else 1}",  # the same number of steps: 16 epochs of 1/16
                "trainer=cpu",
                "print_config=false",
                "~callbacks.progress_bar",
                "trainer.enable_progress_bar=false",
                "~callbacks.loss_curves",
                f"hydra.run.dir={run_dir}",
            ]
            peak, wall, code = _peak_memory_of(command, ROOT)
            peaks[suffix] = peak
            size = sum(f.stat().st_size for g in given for f in _files_of(Path(g.split("=", 1)[1])))
            print(
                f"{name}{' 1/16' if suffix else ''}: {size / GIB:.2f} GiB of data, "
                f"peak RSS: main {peak['main'] / MIB:.0f} MiB, largest worker {peak['worker'] / MIB:.0f} MiB, "
                f"all processes together {peak['together'] / MIB:.0f} MiB; "
                f"{wall:.0f} s, exit {code}",
                flush=True,
            )
        grew = {k: (peaks[""][k] - peaks["_16"][k]) / MIB for k in ("main", "worker", "together")}
        print(f"  {name}: full - 1/16: " + ", ".join(f"{k} {v:+.0f} MiB" for k, v in grew.items()), flush=True)


def _files_of(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return [p for p in path.rglob("*") if p.is_file() or p.is_symlink()]


def loader(root: Path) -> None:
    import torch
    from torch import nn

    from multiloss.data import ImagesDataModule
    from multiloss.data.export import write_image_classes

    folder = root / "images64"
    if not folder.exists():
        rng = np.random.default_rng(1)
        write_image_classes(folder, rng.integers(0, 256, (4096, 64, 64, 3), dtype=np.uint8), np.arange(4096) % 10)
    dm = ImagesDataModule(str(folder), batch_size=64, num_workers=2, val_fraction=0.0)
    dm.setup("fit")
    torch.manual_seed(0)
    layers, channels = [], 3
    for width in (32, 64, 128, 128):
        layers += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2)]
        channels = width
    net = nn.Sequential(*layers, nn.Flatten(), nn.Linear(128 * 4 * 4, 10))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)

    def step(batch: dict) -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(batch["x"]), batch["y"]).backward()
        optimizer.step()

    held = [b for _, b in zip(range(10), iter(dm.train_dataloader()), strict=False)]  # in memory
    loading = iter(dm.train_dataloader())
    step(next(loading))  # workers started, warm
    times: dict[str, list[float]] = {"loader": [], "memory": []}
    for _block in range(4):
        for _ in range(10):
            t = time.perf_counter()
            step(next(loading))
            times["loader"].append(time.perf_counter() - t)
        for batch in held:
            t = time.perf_counter()
            step(batch)
            times["memory"].append(time.perf_counter() - t)
    a, b = statistics.median(times["loader"]), statistics.median(times["memory"])
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"4-layer conv net, 3×64×64, batch 64: step with the loader (2 workers) {a * 1e3:.1f} ms, "
        f"on in-memory tensors {b * 1e3:.1f} ms: ratio {a / b:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["generate", "memory", "loader"])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--gib", type=float, default=4.0)
    args = parser.parse_args()
    {
        "generate": lambda: generate(args.dir, args.gib),
        "memory": lambda: memory(args.dir),
        "loader": lambda: loader(args.dir),
    }[args.what]()


if __name__ == "__main__":
    main()
