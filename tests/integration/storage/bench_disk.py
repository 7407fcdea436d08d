"""Disk L2 throughput against the plain system calls on the same machine, in the same run.

    .venv/bin/python tests/integration/storage/bench_disk.py [--dir DIR] [--mib 32] [--count 16]

Prints one JSON object. For each mode (buffered, O_DIRECT) and each direction: GB/s of the disk
adapter (store with fsync; load) and of a plain baseline over the same bytes (open, write, fsync,
close; open, read, close), and their ratio. `plain_read_fresh` reads each file into new memory, as
a load must (it hands the bytes out); with O_DIRECT that memory is the main cost of a load. Each
figure is the best of a few rounds, alternating adapter and baseline, because this machine is
noisy. Reads are from the page cache in buffered mode (both sides alike), from the device with
O_DIRECT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from storage import codec
from storage.codec import CodecOptions
from storage.disk.adapter import DiskAdapter
from storage.disk.config import DiskAdapterConfig

ROUNDS = 5


def _aligned(data: bytes) -> mmap.mmap:
    buf = mmap.mmap(-1, (len(data) + 4095) // 4096 * 4096)
    buf[: len(data)] = data
    return buf


def baseline_write(root: Path, data: bytes, count: int, direct: bool) -> float:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    source: bytes | mmap.mmap = _aligned(data) if direct else data
    started = time.perf_counter()
    for i in range(count):
        fd = os.open(root / f"plain-{i}", flags, 0o644)
        os.write(fd, source)
        os.fsync(fd)
        os.close(fd)
    return time.perf_counter() - started


def baseline_read(root: Path, size: int, count: int, direct: bool, fresh: bool = False) -> float:
    """Plain reads; with O_DIRECT into one reused buffer, or a fresh one per file (`fresh`)."""
    length = (size + 4095) // 4096 * 4096
    buf = mmap.mmap(-1, length)
    started = time.perf_counter()
    for i in range(count):
        fd = os.open(root / f"plain-{i}", os.O_RDONLY | (os.O_DIRECT if direct else 0))
        if direct:
            if fresh:
                buf = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
            os.preadv(fd, [buf], 0)
        else:
            os.read(fd, size)
        os.close(fd)
    return time.perf_counter() - started


async def adapter_rounds(root: Path, payload: bytes, count: int, direct: bool) -> dict[str, Any]:
    config = DiskAdapterConfig(fsync="always", o_direct=direct, capacity_gb=64)
    executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="bench-disk-io")
    disk = DiskAdapter(config, root / "l2", executor, owns_executor=True)
    await disk.start()
    blobs = [codec.encode(f"key-{i}", b"layoutfp", payload, CodecOptions()) for i in range(count)]
    nbytes = sum(b.nbytes for b in blobs)
    best = {"store_s": float("inf"), "load_s": float("inf"), "plain_write_s": float("inf")}
    best["plain_read_s"] = best["plain_read_fresh_s"] = float("inf")
    for _ in range(ROUNDS):
        started = time.perf_counter()
        for b in blobs:  # one at a time, like the baseline
            (result,) = await disk.store([(b.key, b)])
            assert result.ok, result
        best["store_s"] = min(best["store_s"], time.perf_counter() - started)
        best["plain_write_s"] = min(best["plain_write_s"], baseline_write(root, payload, count, direct))
        started = time.perf_counter()
        for b in blobs:
            (loaded,) = await disk.load([b.key])
            assert loaded.ok, loaded
        best["load_s"] = min(best["load_s"], time.perf_counter() - started)
        best["plain_read_s"] = min(best["plain_read_s"], baseline_read(root, len(payload), count, direct))
        best["plain_read_fresh_s"] = min(
            best["plain_read_fresh_s"], baseline_read(root, len(payload), count, direct, fresh=True)
        )
    await disk.close()
    gbs = {name.removesuffix("_s") + "_gbps": round(nbytes / secs / 1e9, 3) for name, secs in best.items()}
    gbs["store_vs_plain"] = round(gbs["store_gbps"] / gbs["plain_write_gbps"], 3)
    gbs["load_vs_plain"] = round(gbs["load_gbps"] / gbs["plain_read_gbps"], 3)
    gbs["direct_fallback"] = disk.direct_fallback  # type: ignore[assignment]
    return gbs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--mib", type=int, default=32, help="size of one blob in MiB")
    parser.add_argument("--count", type=int, default=16, help="blobs per round")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvdepot-bench-", dir=args.dir))
    payload = os.urandom(args.mib << 20)
    try:
        report: dict[str, Any] = {"blob_mib": args.mib, "count": args.count, "dir": str(root)}
        for mode, direct in (("buffered", False), ("o_direct", True)):
            report[mode] = asyncio.run(adapter_rounds(root, payload, args.count, direct))
            shutil.rmtree(root / "l2")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
