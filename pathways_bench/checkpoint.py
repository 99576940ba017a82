"""``python -m pathways bench checkpoint``: checkpoints the workers write and read
themselves (``pw.save`` / ``pw.load``), next to the file system's own speed for the same
files, measured beside them.

A local cluster of two hosts of two CPU devices each, whose checkpoint directory is a
fresh folder of the temporary directory's file system. An array of ``SIZE`` bytes
(float32) is laid out over the four devices in quarters (``P("a", "b")``), so that each
host holds half of it in two blocks. Every round, alternately:

- *pw.save*: ``pw.save`` of the array into a new directory, from the call until every
  block is written (each host writes its two blocks as ``.npy`` files, under a temporary
  name, renamed once whole; no byte passes through the client);
- *one writer*, *two writers*: this process writes the same four blocks as the same files
  the same way (``np.save`` to a temporary name, then renamed), from one thread, or from
  two threads of two blocks each, as the two hosts do;
- *pw.load*: ``pw.load`` of the saved array into the same layout, until it is ready on
  the devices;
- *one reader*: this process reads the four files back (``np.load``).

Each case's files are deleted before the next case. Nothing is synced to the disk, by the
workers or by the baselines: both measure what the file system gives a program (on this
machine, mostly its page cache).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time
from typing import Callable

import numpy as np

from pathways_bench import report

TITLE = "Checkpoints: the workers' pw.save and pw.load against the file system's speed for the same files"
PAPER = ""
PAPER_RESULT = ""
ROUNDS = 7
SIZE = 256 << 20
TINY_SIZE = 16 << 20
TARGET = 0.8  # pw.save's MB/s against the faster writer's
_TIMEOUT = 600.0
_WRITERS = ("one writer", "two writers")

ABOUT = """
`pw.local_cluster(hosts=2, devices_per_host=2, checkpoint_dir=DIR)`; a float32 array of 256
MiB laid out in quarters over the four devices (`P("a", "b")`: each host holds half of it,
as two blocks), saved and loaded once first. Alternately, every round: **pw.save** of the
array into a new directory, until every block is written (each host writes its own blocks,
`.npy` files under a temporary name renamed once whole; no byte passes through the client);
**one writer** and **two writers**: this process writing the same four blocks as the same
files the same way (`np.save` to a temporary name, renamed), from one thread or from two
threads of two blocks each, as the two hosts do; **pw.load** of the saved array into the
same layout, until it is ready on the devices; **one reader**: `np.load` of the four files
in this process. The files of each case are deleted before the next. Nothing is synced to
disk by anyone: each figure is what the file system gives a program (here mostly the page
cache). MB/s is 10^6 bytes of array per second.
"""


def measure(rounds: int, tiny: bool, progress: report.Progress) -> dict:
    import pathways as pw

    size = TINY_SIZE if tiny else SIZE
    side = int(np.sqrt(size // 4))
    value = np.random.default_rng(0).standard_normal((side, side), dtype=np.float32)
    half = side // 2  # the four blocks, each contiguous as a device's buffer is
    blocks = [np.ascontiguousarray(value[r:r + half, c:c + half]) for r in (0, half) for c in (0, half)]
    root = tempfile.mkdtemp(prefix="pathways-bench-checkpoint-")
    progress.expect(1 + 5 * rounds)
    try:
        with pw.local_cluster(hosts=2, devices_per_host=2, checkpoint_dir=root):
            s = pw.make_virtual_device_set().add_slice(cpu_devices=4, mesh_shape=(2, 2))
            sharding = pw.NamedSharding(s.mesh(("a", "b")), pw.P("a", "b"))
            array = pw.device_put(value, sharding)
            array.block_until_ready(timeout=_TIMEOUT)
            count = iter(range(1 << 30))

            def fresh() -> str:
                return os.path.join(root, f"c{next(count)}")

            warm = fresh()  # the first save and load of a process pay for what numpy loads then
            pw.save({"w": array}, warm, timeout=_TIMEOUT)
            pw.load(warm, {"w": array})["w"].block_until_ready(timeout=_TIMEOUT)
            shutil.rmtree(warm)
            progress.step("the array put, saved and loaded once")

            def pw_save() -> float:
                path = fresh()
                began = time.perf_counter()
                pw.save({"w": array}, path, timeout=_TIMEOUT)
                took = time.perf_counter() - began
                shutil.rmtree(path)
                return took

            def pw_load() -> float:
                path = fresh()
                pw.save({"w": array}, path, timeout=_TIMEOUT)
                began = time.perf_counter()
                loaded = pw.load(path, {"w": array})["w"]
                loaded.block_until_ready(timeout=_TIMEOUT)
                took = time.perf_counter() - began
                if not np.array_equal(np.asarray(loaded), value):
                    raise RuntimeError("pw.load gave other values than were saved")
                shutil.rmtree(path)
                return took

            def reader() -> float:
                path = fresh()
                _write(path, blocks, 1)
                began = time.perf_counter()
                for i in range(len(blocks)):
                    np.load(os.path.join(path, f"{i}.npy"))
                took = time.perf_counter() - began
                shutil.rmtree(path)
                return took

            cases: dict[str, Callable[[], float]] = {
                "pw.save": pw_save,
                "one writer": lambda: _timed_write(fresh(), blocks, 1),
                "two writers": lambda: _timed_write(fresh(), blocks, 2),
                "pw.load": pw_load,
                "one reader": reader,
            }
            samples = report.alternate(rounds, cases, progress)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"bytes": value.nbytes, "cases": {name: report.stats([value.nbytes / t / 1e6 for t in ts])
                                             for name, ts in samples.items()},
            "seconds": {name: statistics.median(ts) for name, ts in samples.items()}}


def _timed_write(path: str, blocks: list[np.ndarray], threads: int) -> float:
    began = time.perf_counter()
    _write(path, blocks, threads)
    took = time.perf_counter() - began
    shutil.rmtree(path)
    return took


def _write(path: str, blocks: list[np.ndarray], threads: int) -> None:
    """``blocks`` as ``path/I.npy``, each written under a temporary name and renamed, by
    ``threads`` threads sharing them evenly (as the workers write theirs)."""
    os.makedirs(path)

    def write(indices: range) -> None:
        for i in indices:
            final = os.path.join(path, f"{i}.npy")
            with open(final + ".partial", "wb") as f:
                np.save(f, blocks[i], allow_pickle=False)
            os.replace(final + ".partial", final)

    share = len(blocks) // threads
    workers = [threading.Thread(target=write, args=(range(t * share, (t + 1) * share),)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def tables(data: dict) -> list:
    c, sec = data["cases"], data["seconds"]
    rows = [[name, report.rate(c[name]), f"{sec[name] * 1e3:.0f}"] for name in c]
    return [report.Table(f"{data['bytes'] / 2**20:.0f} MiB over 2 hosts x 2 devices: MB/s, median (min-max)",
                         ["case", "MB/s", "ms (median)"], rows)]


def _ratios(data: dict) -> tuple[float, str, float]:
    c = data["cases"]
    best = max(_WRITERS, key=lambda name: c[name]["median"])
    return report.ratio(c["pw.save"], c[best]), best, report.ratio(c["pw.load"], c["one reader"])


def summary(data: dict) -> list[str]:
    save, best, load = _ratios(data)
    met = report.verdict(data, save >= TARGET, f"missed by {TARGET - save:.2f}")
    return [*report.unjudged(data),
            f"pw.save at {report.times(save)} the faster of this process's writers of the same files ({best}); "
            f"target >= {TARGET}x: {met}",
            f"pw.load at {report.times(load)} this process reading the same files (not a target; the two hosts "
            "read their halves at once, each block with one copy into a buffer aligned for its device)"]


def notes(data: dict) -> str:
    return ("A save is one gRPC call per host, answered once its blocks are on the file system; the hosts "
            "write in parallel, each from the device buffers it holds. Both sides write into the page cache "
            "here, so the figures compare the cost of writing through the runtime with writing from a "
            "program, not the disk's own speed.")


def plot(data: dict, path: str) -> None:
    c = data["cases"]
    report.plot_bars(path, TITLE[:60], "MB/s (median)", list(c), {"MB/s": [c[name]["median"] for name in c]})
