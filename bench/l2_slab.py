"""`kvdepot bench l2 --adapter slab`: the slab tier through the sidecar's controllers, against two
baselines measured in the same run on the same bytes:

  raw    the same slab file written with O_DIRECT at the slots' offsets, one chunk per pwrite
         from aligned memory (faulted in), one fdatasync at the end, then read back the same way:
         once sequentially (one stream), once with as many streams as the slab's I/O threads.
         Measured before the slab (on random bytes of the same size) and after it (on the slab's
         own bytes), since other work on the machine moves the device's speed: `raw_*_gbps` is the
         mean of the two passes, each the better of one and four streams (what the file and the
         device can do: the slab's goal is >= 0.9 x it); each pass is printed
  disk   the file-per-chunk disk adapter through the same controllers, fsync always and O_DIRECT
         (`o_direct: true`), so that its loads are cold like the slab's

Both adapters keep their files under the run's data dir (l2.allowed_roots defaults to it). The slab
file is written with zeros (`prefill`) and formatted before anything is timed; the raw passes write
over its slots, never its superblock. `adapter_only`: the slab adapter called directly on the same
file and bytes (no controllers, no checksums: what the adapter itself costs against raw), in ROUNDS
rounds each right after a raw pass (the better of one and four streams), the median of the rounds'
ratios. Every timed phase starts after `settle` (sync and a --settle-s pause, SETTLE_S by
default). Order: raw (before), slab, adapter_only, raw (after), disk. Prints one JSON object: GB/s
of each, the ratios, the filesystem of --dir, and whether every chunk came back byte for byte
(`ok`, `disk_ok`, `raw_ok`).
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import random
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage.slab import headers as fmt

SLAB_IO_THREADS = 4  # the slab adapter's default io_threads, used in the run and the parallel baseline
ROUNDS = 3  # of the adapter alone, each after a raw pass
SETTLE_S = 3.0  # pause before each timed phase (the default of --settle-s)


def filesystem_of(path: Path) -> str:
    """The type of the filesystem `path` lies on, from /proc/mounts (the longest mount prefix)."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                _dev, point, fstype = line.split()[:3]
                point = point.replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fstype
    except OSError:
        pass
    return kind


def _transfer(fd: int, view: memoryview, offset: int, write: bool) -> None:
    done = 0
    while done < view.nbytes:
        part = view[done:]
        n = os.pwritev(fd, [part], offset + done) if write else os.preadv(fd, [part], offset + done)
        if n <= 0:
            raise OSError("short O_DIRECT transfer")
        done += n


def _populated(size: int) -> mmap.mmap:
    """Page-aligned memory, faulted in up front (as the L1 arena is), so that no timed transfer
    pays page faults."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))


def prefill(path: Path, size: int) -> None:
    """Create the slab file and write zeros over all of it, untimed: every block is then written
    once, as in a slab that has run a while, so that no timed write (the slab's or the raw
    baseline's) pays the filesystem's conversion of preallocated, unwritten extents. The adapter
    formats a file whose first block is zeros."""
    path.parent.mkdir(parents=True, exist_ok=True)
    zeros = _populated(8 << 20)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        for offset in range(0, size, len(zeros)):
            _transfer(fd, memoryview(zeros)[: min(len(zeros), size - offset)], offset, write=True)
        os.fdatasync(fd)
    finally:
        os.close(fd)


def settle(pause_s: float = SETTLE_S) -> None:
    """Before each timed phase: the previous phases' writes flushed (sync) and a pause, so that a
    device still busy with them (a virtual disk's host cache) does not slow the next phase."""
    os.sync()
    time.sleep(pause_s)


def _raw_pass(fd: int, views: list[memoryview], offsets: list[int], threads: int, write: bool) -> float:
    """Seconds to move every view to/from its offset, `threads` transfers at a time (one per
    chunk), with one fdatasync after writes."""
    start = time.perf_counter()
    if threads == 1:
        for view, offset in zip(views, offsets, strict=True):
            _transfer(fd, view, offset, write)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda i: _transfer(fd, views[i], offsets[i], write), range(len(views))))
    if write:
        os.fdatasync(fd)
    return time.perf_counter() - start


@dataclass(frozen=True, slots=True)
class RawFigures:
    """Seconds per pass: one stream, and `threads` streams at once; whether the bytes came back."""

    write_s: float
    read_s: float
    write_parallel_s: float
    read_parallel_s: float
    intact: bool

    @property
    def best_write_s(self) -> float:
        return min(self.write_s, self.write_parallel_s)

    @property
    def best_read_s(self) -> float:
        return min(self.read_s, self.read_parallel_s)

    def figures(self, nbytes: int) -> dict[str, float]:
        return {"sequential_write_gbps": _gbps(nbytes, self.write_s),
                "sequential_read_gbps": _gbps(nbytes, self.read_s),
                "parallel_write_gbps": _gbps(nbytes, self.write_parallel_s),
                "parallel_read_gbps": _gbps(nbytes, self.read_parallel_s)}  # fmt: skip


def raw_direct(
    path: Path, payloads: list[bytes], offset: int, stride: int, threads: int, *, pause_s: float = SETTLE_S
) -> RawFigures:
    """The payloads written at offset + i * stride with O_DIRECT, one pwrite each from aligned
    memory, then read back the same way into aligned memory: first one at a time (sequential),
    then `threads` at a time (as many as the slab adapter's I/O threads)."""
    size = len(payloads[0])
    aligned = fmt.round_up(size)
    source, target = _populated(aligned * len(payloads)), _populated(aligned * len(payloads))
    for i, data in enumerate(payloads):
        source[i * aligned : i * aligned + size] = data
    sources = [memoryview(source)[i * aligned : (i + 1) * aligned] for i in range(len(payloads))]
    targets = [memoryview(target)[i * aligned : (i + 1) * aligned] for i in range(len(payloads))]
    offsets = [offset + i * stride for i in range(len(payloads))]
    fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
    try:
        settle(pause_s)
        write_s = _raw_pass(fd, sources, offsets, 1, write=True)
        read_s = _raw_pass(fd, targets, offsets, 1, write=False)
        intact = all(bytes(target[i * aligned : i * aligned + size]) == p for i, p in enumerate(payloads))
        settle(pause_s)
        write_parallel_s = _raw_pass(fd, sources, offsets, threads, write=True)
        read_parallel_s = _raw_pass(fd, targets, offsets, threads, write=False)
    finally:
        os.close(fd)
    intact = intact and all(
        bytes(target[i * aligned : i * aligned + size]) == p for i, p in enumerate(payloads)
    )
    return RawFigures(write_s, read_s, write_parallel_s, read_parallel_s, intact)


async def formatted(config: dict[str, Any], checkpoint: Path) -> None:
    """The slab file formatted by the adapter (started, then closed at once)."""
    from storage.slab.adapter import SlabAdapter
    from storage.slab.config import SlabAdapterConfig

    cfg = SlabAdapterConfig.model_validate(config)
    executor = ThreadPoolExecutor(1, thread_name_prefix="kvdepot-bench-slab")
    slab = SlabAdapter(cfg, checkpoint.parent / "unused", checkpoint, executor, owns_executor=True)
    try:
        await slab.start()
    finally:
        await slab.close()


@dataclass(frozen=True, slots=True)
class Round:
    """One round of the adapter alone and the raw I/O right before it, seconds each."""

    raw_write_s: float
    raw_read_s: float
    store_s: float
    load_s: float


async def adapter_only(
    config: dict[str, Any], payloads: list[bytes], checkpoint: Path, rounds: int, pause_s: float = SETTLE_S
) -> tuple[list[Round], bool]:
    """The slab adapter alone, on the file the controllers used, `rounds` times, each right after
    a raw pass over the same slots from the same memory (the better of one stream and as many as
    the adapter's I/O threads), so that each ratio compares neighbours in time: every payload stored
    in one batch (encoded beforehand, untimed), then loaded back in one load_into batch into
    aligned memory. What the adapter adds to the raw I/O, without the controllers' pipeline and
    checksums. Also whether every byte came back, every round."""
    from storage import codec
    from storage.slab.adapter import SlabAdapter
    from storage.slab.config import SlabAdapterConfig

    cfg = SlabAdapterConfig.model_validate(config)
    size, count = len(payloads[0]), len(payloads)
    stride = fmt.round_up(size)
    source, target = _populated(stride * count), _populated(stride * count)
    for i, data in enumerate(payloads):
        source[i * stride : i * stride + size] = data
    sources = [memoryview(source)[i * stride : i * stride + size] for i in range(count)]
    outs = [memoryview(target)[i * stride : i * stride + size] for i in range(count)]
    raw_views = [memoryview(source)[i * stride : (i + 1) * stride] for i in range(count)]
    raw_outs = [memoryview(target)[i * stride : (i + 1) * stride] for i in range(count)]
    offsets = [fmt.ALIGN + i * cfg.slot_bytes for i in range(count)]
    executor = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="kvdepot-bench-slab")
    slab = SlabAdapter(cfg, checkpoint.parent / "unused", checkpoint, executor, owns_executor=True)
    found: list[Round] = []
    ok = True
    fd = os.open(cfg.paths[0], os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
    try:
        await slab.start()
        for r in range(rounds):
            raw_write_s, raw_read_s = float("inf"), float("inf")
            for streams in (1, cfg.io_threads):  # the better of one stream and as many as the adapter's
                settle(pause_s)
                raw_write_s = min(raw_write_s, _raw_pass(fd, raw_views, offsets, streams, write=True))
                raw_read_s = min(raw_read_s, _raw_pass(fd, raw_outs, offsets, streams, write=False))
            keys = [f"bench-{r}-{i}" for i in range(count)]
            blobs = [
                (k, codec.encode(k, bytes(8), v, codec.CodecOptions()))
                for k, v in zip(keys, sources, strict=True)
            ]
            settle(pause_s)
            start = time.perf_counter()
            stored = await slab.store(blobs)
            store_s = time.perf_counter() - start
            start = time.perf_counter()
            loaded = await slab.load_into(keys, outs)
            load_s = time.perf_counter() - start
            found.append(Round(raw_write_s, raw_read_s, store_s, load_s))
            ok = ok and all(x.ok for x in stored) and all(x.ok and x.in_place for x in loaded)
            ok = ok and all(bytes(out) == data for out, data in zip(outs, payloads, strict=True))
    finally:
        os.close(fd)
        await slab.close()
    return found, ok


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


async def _both(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from bench.l2_phases import layout_of

    layout = layout_of(args)
    chunks = args.requests * args.chunks_per_request
    slot = fmt.payload_offset(1024) + fmt.round_up(layout.chunk_bytes)
    slab_file = workdir / "s" / "data" / "slab"
    slab_config = {"type": "slab", "name": "slab", "paths": [str(slab_file)], "slot_bytes": slot,
                   "size_bytes": fmt.ALIGN + chunks * slot, "io_threads": SLAB_IO_THREADS}  # fmt: skip
    prefill(slab_file, slab_config["size_bytes"])
    await formatted(slab_config, workdir / "format.index")  # the raw passes leave its superblock be
    rng = random.Random(0)
    pause_s = args.settle_s
    before = raw_direct(
        slab_file, [rng.randbytes(layout.chunk_bytes) for _ in range(chunks)], fmt.ALIGN, slot,
        SLAB_IO_THREADS, pause_s=pause_s,
    )  # fmt: skip
    settle(pause_s)
    slab = await _controllers(args, workdir / "s", slab_config)
    rounds, alone_ok = await adapter_only(
        slab_config, slab["payloads"], workdir / "alone.index", ROUNDS, pause_s
    )
    after = raw_direct(slab_file, slab["payloads"], fmt.ALIGN, slot, SLAB_IO_THREADS, pause_s=pause_s)
    raw_write_s = (before.best_write_s + after.best_write_s) / 2
    raw_read_s = (before.best_read_s + after.best_read_s) / 2
    disk_dir = workdir / "d"
    disk_config = {"type": "disk", "name": "disk", "paths": [str(disk_dir / "data" / "l2")],
                   "capacity_gb": 64, "o_direct": True}  # fmt: skip
    settle(pause_s)
    disk = await _controllers(args, disk_dir, disk_config)
    total = chunks * layout.chunk_bytes
    return {
        "adapter": "slab",
        "filesystem": filesystem_of(workdir),
        "store_gbps": _gbps(total, slab["store_s"]),
        "load_gbps": _gbps(total, slab["load_s"]),
        "raw_write_gbps": _gbps(total, raw_write_s),
        "raw_read_gbps": _gbps(total, raw_read_s),
        "raw_before": before.figures(total),
        "raw_after": after.figures(total),
        "store_vs_raw": round(raw_write_s / slab["store_s"], 3),
        "load_vs_raw": round(raw_read_s / slab["load_s"], 3),
        "adapter_only": {
            "store_vs_raw": round(statistics.median(r.raw_write_s / r.store_s for r in rounds), 3),
            "load_vs_raw": round(statistics.median(r.raw_read_s / r.load_s for r in rounds), 3),
            "rounds": [
                {
                    "store_gbps": _gbps(total, r.store_s),
                    "load_gbps": _gbps(total, r.load_s),
                    "raw_write_gbps": _gbps(total, r.raw_write_s),
                    "raw_read_gbps": _gbps(total, r.raw_read_s),
                }
                for r in rounds
            ],
            "ok": alone_ok,
        },
        "disk_store_gbps": _gbps(total, disk["store_s"]),
        "disk_load_gbps": _gbps(total, disk["load_s"]),
        "store_vs_disk": round(disk["store_s"] / slab["store_s"], 3),
        "load_vs_disk": round(disk["load_s"] / slab["load_s"], 3),
        "chunks": chunks,
        "chunk_bytes": layout.chunk_bytes,
        "slot_bytes": slot,
        "written": slab["written"],
        "hit_chunks": slab["hit_chunks"],
        "ok": slab["ok"],
        "raw_ok": before.intact and after.intact,
        "disk_ok": disk["ok"],
    }


def run_slab(args: argparse.Namespace) -> dict[str, Any]:
    """Measure (see the module docstring) in a fresh directory under args.dir, removed afterwards."""
    workdir = Path(tempfile.mkdtemp(prefix="kvd-slab-", dir=args.dir))
    try:
        return asyncio.run(_both(args, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def _controllers(args: argparse.Namespace, workdir: Path, adapter: dict[str, Any]) -> dict[str, Any]:
    """The adapter's store (write-behind until idle) and load (prefetch into an emptied L1) through
    the sidecar's own controllers, built in this process; no baseline phases in between (the slab
    bench measures its baselines around this call). Loads are cold for both O_DIRECT tiers."""
    import gc

    from app.main import Service
    from bench.l2_phases import bench_settings, fill, layout_of, time_load, time_store, wait_ready

    layout = layout_of(args)
    service = Service(bench_settings(args, workdir, adapter, layout))
    service.build()
    runner = asyncio.get_running_loop().create_task(service.run())
    try:
        await wait_ready(service)
        engine = service.engine
        assert engine is not None
        eid = engine.register("bench-model", layout).engine_id
        requests = fill(engine, eid, args)
        gc.collect()
        gc.freeze()
        store_s, written = await time_store(engine, eid, requests)
        load = await time_load(engine, eid, requests, "load")
        n_chunks = sum(len(r.payloads) for r in requests)
        return {
            "store_s": store_s, "load_s": load.seconds, "written": written, "hit_chunks": load.hit_chunks,
            "ok": written == n_chunks and load.hit_chunks == n_chunks and load.identical,
            "payloads": [p for req in requests for p in req.payloads],
        }  # fmt: skip
    finally:
        gc.unfreeze()
        service.request_stop()
        await runner
