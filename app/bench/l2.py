"""`kvdepot bench l2 --adapter disk|slab|redis|mock`: write-behind and prefetch through the
controllers, against a plain baseline of the same bytes measured in the same run. Prints one JSON
object. (slab: app/bench/l2_slab.py, with baselines of its own.)

The sidecar's own wiring is built in-process (no data plane traffic): chunks are reserved and
filled in L1, committed (which queues them for write-behind), and the store figure is the time
until the store controller is idle. Then L1 is cleared and every request is looked up again: the
load figure is the time until the prefetches have put every chunk back into L1, checked byte for
byte afterwards (outside the timing).

Baselines, on the same bytes in the same block size:
  disk   open + write + fsync + close per chunk file; read each file into fresh memory
  redis  a plain redis-py loop: SET of each chunk, then GET of each
  mock   the same bytes copied into fresh memory (what an in-memory tier cannot beat)

Before the timed phases the process's objects are frozen out of the garbage collector (gc.freeze),
so that a full collection of the harness's own heap does not land in one phase of one side.

`mac`: what authenticating the blobs costs, on the same bytes, one thread: keyed BLAKE3 (the MAC
an adapter with `authenticate` signs and checks) against xxh3 (the checksum it replaces on loads),
in GB/s, and the MAC's seconds as a share of the load phase (`load_share`: its CPU time, not
necessarily on the critical path: checks of different chunks run in parallel).

Besides the figures: `written` (chunks written behind) and `hit_chunks` (chunks prefetched back),
which say what went wrong when `ok` is false, and for redis `redis_cpu_s`: the CPU seconds the Redis
server's main thread spent in each phase (INFO cpu; other clients of a shared Redis included),
which tells the server's share of the time from the client's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.main import Service
from app.settings import Settings
from app.settings_load import load_settings
from engine.facade import CacheEngine
from engine.keys import KVLayout
from engine.results import SlotStatus, StoreSlot
from kvdepot_connector.protocol import encode_tokens


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapter", choices=["disk", "slab", "redis", "mock"], default="disk")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--chunks-per-request", type=int, default=8)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument(
        "--cold",
        action="store_true",
        help="disk: drop the written files from the page cache (posix_fadvise) before the loads",
    )
    p.add_argument(
        "--dir", type=Path, help="directory for the disk adapter and its baseline (default: a temp dir)"
    )


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _drop_cached(root: Path) -> None:
    """Evict every file under `root` from the page cache (its pages are clean: written and
    fsync-ed), so that the next reads come from the device."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _disk_baseline(root: Path, chunks: list[bytes], cold: bool) -> tuple[float, float]:
    root.mkdir(parents=True, exist_ok=True)
    paths = [root / f"baseline-{i}" for i in range(len(chunks))]
    start = time.perf_counter()
    for path, data in zip(paths, chunks, strict=True):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    store_s = time.perf_counter() - start
    if cold:
        _drop_cached(root)
    start = time.perf_counter()
    for path, data in zip(paths, chunks, strict=True):
        buf = bytearray(len(data))
        with open(path, "rb", buffering=0) as f:
            f.readinto(buf)
    load_s = time.perf_counter() - start
    for path in paths:
        path.unlink()
    return store_s, load_s


def _cpu_seconds(info: dict[str, Any]) -> float:
    """The Redis main thread's CPU seconds (background threads, e.g. lazy frees, apart)."""
    main = ("used_cpu_sys_main_thread", "used_cpu_user_main_thread")
    names = main if all(n in info for n in main) else ("used_cpu_sys", "used_cpu_user")
    return sum(float(info[n]) for n in names)


async def _redis_cpu(url: str) -> float:
    import redis.asyncio

    async with redis.asyncio.Redis.from_url(url) as r:
        return _cpu_seconds(await r.info("cpu"))


def _redis_baseline(url: str, chunks: list[bytes], cpu: dict[str, float]) -> tuple[float, float]:
    import redis

    prefix = f"kvdepot-bench-baseline-{uuid.uuid4().hex[:8]}:"
    r = redis.Redis.from_url(url)
    try:
        cpu0 = _cpu_seconds(r.info("cpu"))
        start = time.perf_counter()
        for i, data in enumerate(chunks):
            r.set(f"{prefix}{i}", data)
        store_s = time.perf_counter() - start
        cpu1 = _cpu_seconds(r.info("cpu"))
        start = time.perf_counter()
        for i in range(len(chunks)):
            r.get(f"{prefix}{i}")
        load_s = time.perf_counter() - start
        cpu2 = _cpu_seconds(r.info("cpu"))
        cpu.update(baseline_store=round(cpu1 - cpu0, 3), baseline_load=round(cpu2 - cpu1, 3))
        for i in range(len(chunks)):
            r.unlink(f"{prefix}{i}")
    finally:
        r.close()
    return store_s, load_s


def _mac_cost(chunks: list[bytes], load_s: float) -> dict[str, float]:
    """One thread: keyed BLAKE3 and xxh3 over the chunks, in GB/s; the MAC's share of load_s."""
    import blake3
    import xxhash

    key = bytes(32)
    start = time.perf_counter()
    for chunk in chunks:
        blake3.blake3(chunk, key=key).digest()
    mac_s = time.perf_counter() - start
    start = time.perf_counter()
    for chunk in chunks:
        xxhash.xxh3_128_digest(chunk)
    xxh3_s = time.perf_counter() - start
    total = sum(len(c) for c in chunks)
    return {"mac_gbps": _gbps(total, mac_s), "xxh3_gbps": _gbps(total, xxh3_s),
            "load_share": round(mac_s / load_s, 3)}  # fmt: skip


def _memory_baseline(chunks: list[bytes]) -> tuple[float, float]:
    start = time.perf_counter()
    copies = [bytearray(c) for c in chunks]
    store_s = time.perf_counter() - start
    start = time.perf_counter()
    for c in copies:
        bytearray(c)
    return store_s, time.perf_counter() - start


@dataclass
class _Written:
    """One request's tokens, the L1 slots its chunks were written to, and the bytes written."""

    tokens: bytes
    slots: list[StoreSlot]
    payloads: list[bytes]


class _CpuProbe:
    """The server's CPU seconds at each mark (none without a probe), for the time between marks."""

    def __init__(self, read: Callable[[], Awaitable[float]] | None) -> None:
        self._read = read
        self.marks: list[float] = []

    async def mark(self) -> None:
        if self._read is not None:
            self.marks.append(await self._read())

    def phases(self) -> dict[str, float]:
        m = self.marks
        return {"store": round(m[1] - m[0], 3), "load": round(m[2] - m[1], 3)} if m else {}


def _layout(args: argparse.Namespace) -> KVLayout:
    return KVLayout("float16", args.layers, args.kv_heads, args.head_dim, args.chunk_tokens, "layer-kv",
                    args.chunk_tokens)  # fmt: skip


def _settings(args: argparse.Namespace, workdir: Path, adapter: dict[str, Any], layout: KVLayout) -> Settings:
    n_chunks = args.requests * args.chunks_per_request
    return load_settings(
        {
            "data_dir": workdir / "data", "http.port": 0, "l1.chunk_size": args.chunk_tokens,
            "l1.size_gb": layout.chunk_bytes * n_chunks * 1.3 / (1 << 30) + 0.05,
            "l2.adapters": [adapter], "l2.prefetch_deadline_ms": 60_000, "l2.store_queue_depth": n_chunks,
            "data_plane.url": f"ipc://{workdir}/bench.sock",
        }
    )  # fmt: skip


def _fill(engine: CacheEngine, eid: int, args: argparse.Namespace) -> list[_Written]:
    """Reserve every request's chunks in L1 and fill them with random bytes (not committed yet)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    requests = []
    for r in range(args.requests):
        ids = torch.randint(0, 50_000, (args.chunks_per_request * args.chunk_tokens,), generator=gen)
        tokens = encode_tokens(ids.tolist())
        slots = engine.store(eid, f"w{r}", tokens, "")
        if any(s.status is not SlotStatus.RESERVED for s in slots):
            raise RuntimeError("L1 too small for the benchmark")
        for s in slots:
            engine.arena.tensor(s.offset, s.size).copy_(
                torch.randint(0, 256, (s.size,), dtype=torch.uint8, generator=gen)
            )
        requests.append(_Written(tokens, slots, [bytes(engine.arena.view(s.offset, s.size)) for s in slots]))
    return requests


async def _time_store(engine: CacheEngine, eid: int, requests: list[_Written]) -> tuple[float, int]:
    """Commit everything (queued for write-behind); seconds until the store controller is idle,
    and the chunks it wrote."""
    assert engine.l2 is not None
    start = time.perf_counter()
    for req in requests:
        engine.commit(eid, [s.oid for s in req.slots])
    if not await engine.l2.store.wait_idle(600):
        raise RuntimeError("write-behind did not finish")
    return time.perf_counter() - start, engine.l2.store.counters.written


async def _time_load(engine: CacheEngine, eid: int, requests: list[_Written]) -> tuple[float, list[int]]:
    """Look every request up again (L1 is empty); seconds until every prefetch is done, and the
    chunks each request then hits."""
    start = time.perf_counter()
    for r, req in enumerate(requests):
        engine.lookup(eid, f"r{r}", req.tokens, "")
    hits = [(await engine.wait_prefetch(eid, f"r{r}")).hit_chunks for r in range(len(requests))]
    return time.perf_counter() - start, hits


async def _through_controllers(
    args: argparse.Namespace,
    workdir: Path,
    adapter: dict[str, Any],
    server_cpu: Callable[[], Awaitable[float]] | None = None,
) -> dict[str, Any]:
    layout = _layout(args)
    n_chunks = args.requests * args.chunks_per_request
    service = Service(_settings(args, workdir, adapter, layout))
    service.build()
    runner = asyncio.get_running_loop().create_task(service.run())
    try:
        await _wait_ready(service)
        engine = service.engine
        assert engine is not None
        eid = engine.register("bench-model", layout).engine_id
        requests = _fill(engine, eid, args)

        # What the process holds by now (torch, the app, the payloads) is moved out of the
        # collector's reach: a full collection over it (~0.1 s) must not land in a timed phase.
        gc.collect()
        gc.freeze()
        cpu = _CpuProbe(server_cpu)
        await cpu.mark()
        store_s, written = await _time_store(engine, eid, requests)
        engine.clear()
        if args.cold and args.adapter == "disk":
            _drop_cached(workdir / "l2")
        await cpu.mark()
        load_s, hits = await _time_load(engine, eid, requests)
        await cpu.mark()
        ok = written == n_chunks and all(h == args.chunks_per_request for h in hits)
        ok = ok and _identical(engine, eid, requests)
        return {"store_s": store_s, "load_s": load_s, "ok": ok, "chunks": n_chunks,
                "chunk_bytes": layout.chunk_bytes, "payloads": [p for req in requests for p in req.payloads],
                "written": written, "hit_chunks": sum(hits), "server_cpu_s": cpu.phases()}  # fmt: skip
    finally:
        gc.unfreeze()
        service.request_stop()
        await runner


def _identical(engine: CacheEngine, eid: int, requests: list[_Written]) -> bool:
    for r, req in enumerate(requests):
        extents = engine.retrieve(eid, f"r{r}", 0, len(req.payloads))
        if any(
            bytes(engine.arena.view(e.offset, e.size)) != p
            for e, p in zip(extents, req.payloads, strict=True)
        ):
            return False
        engine.release(eid, f"r{r}")
    return True


async def _wait_ready(service: Service) -> None:
    for _ in range(600):
        if not service.not_ready():
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"service not ready: {service.not_ready()}")


def _adapter(args: argparse.Namespace, workdir: Path, prefix: str) -> dict[str, Any]:
    adapters: dict[str, dict[str, Any]] = {
        "disk": {"type": "disk", "name": "disk", "paths": [str(workdir / "l2")], "capacity_gb": 64},
        "redis": {"type": "redis", "name": "redis", "url": args.redis_url, "key_prefix": prefix},
        "mock": {"type": "mock", "name": "mock", "capacity_gb": 64},
    }
    return adapters[args.adapter]


def _baseline(args: argparse.Namespace, workdir: Path, got: dict[str, Any]) -> tuple[float, float]:
    """The plain baseline's store and load seconds on the same bytes (see the module docstring)."""
    payloads: list[bytes] = got.pop("payloads")
    got["mac"] = _mac_cost(payloads, got["load_s"])
    if args.adapter == "disk":
        return _disk_baseline(workdir / "baseline", payloads, args.cold)
    if args.adapter == "redis":
        return _redis_baseline(args.redis_url, payloads, got["server_cpu_s"])
    return _memory_baseline(payloads)


def _drop_redis_keys(url: str, prefix: str) -> None:
    import redis

    with redis.Redis.from_url(url) as r:
        for key in r.scan_iter(match=prefix + "*"):
            r.unlink(key)


def _result(
    args: argparse.Namespace, got: dict[str, Any], base_store_s: float, base_load_s: float
) -> dict[str, Any]:
    total = got["chunks"] * got["chunk_bytes"]
    result = {
        "adapter": args.adapter,
        "cold": bool(args.cold and args.adapter == "disk"),
        "store_gbps": _gbps(total, got["store_s"]),
        "load_gbps": _gbps(total, got["load_s"]),
        "baseline_store_gbps": _gbps(total, base_store_s),
        "baseline_load_gbps": _gbps(total, base_load_s),
        "store_vs_baseline": round(base_store_s / got["store_s"], 3),
        "load_vs_baseline": round(base_load_s / got["load_s"], 3),
        "chunks": got["chunks"],
        "chunk_bytes": got["chunk_bytes"],
        "written": got["written"],
        "hit_chunks": got["hit_chunks"],
        "ok": got["ok"],
        "mac": got["mac"],
    }
    if got["server_cpu_s"]:
        result["redis_cpu_s"] = got["server_cpu_s"]
    return result


def run(args: argparse.Namespace) -> int:
    if args.adapter == "slab":  # its own baselines (raw O_DIRECT, the disk adapter): app/bench/l2_slab.py
        from app.bench.l2_slab import run_slab

        slab = run_slab(args)
        print(json.dumps(slab))
        return 0 if slab["ok"] and slab["disk_ok"] else 1
    workdir = Path(tempfile.mkdtemp(prefix="kvdepot-bench-l2-", dir=args.dir))
    prefix = f"kvdepot-bench-{uuid.uuid4().hex[:8]}:"
    url = args.redis_url
    probe = (lambda: _redis_cpu(url)) if args.adapter == "redis" else None
    try:
        got = asyncio.run(_through_controllers(args, workdir, _adapter(args, workdir, prefix), probe))
        base_store_s, base_load_s = _baseline(args, workdir, got)
    finally:
        if args.adapter == "redis":
            _drop_redis_keys(args.redis_url, prefix)
        shutil.rmtree(workdir, ignore_errors=True)
    result = _result(args, got, base_store_s, base_load_s)
    print(json.dumps(result))
    return 0 if result["ok"] else 1
