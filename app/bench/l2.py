"""`kvdepot bench l2 --adapter disk|slab|redis|mock`: write-behind and prefetch through the
controllers, against a plain baseline of the same bytes at the same concurrency, measured in the
same run. Prints one JSON object. (slab: app/bench/l2_slab.py, with baselines of its own.)

The sidecar's own wiring is built in-process (no data plane traffic): chunks are reserved and
filled in L1, committed (which queues them for write-behind), and the store figure is the time
until the store controller is idle. Then L1 is cleared and every request is looked up again: a
load figure is the time until the prefetches have put every chunk back into L1, checked byte for
byte afterwards (outside the timing). The disk adapter is loaded twice: `load_warm` right after
the writes (its files are in the page cache), `load_cold` after every file of the adapter was
dropped from the page cache (posix_fadvise DONTNEED); for Redis and the mock a cold read does not
apply (their bytes live in memory), and `load_cold` says so.

Baselines (app/bench/l2_baselines.py), on the same bytes, with as many threads as the adapter has
I/O threads (`threads`, storage.factory.io_threads: disk `io_threads`, redis the bulk lane's):
  disk   open + write + fsync + close per chunk file; open + read of each file, page-cache and cold
  redis  plain redis-py clients, one connection per thread: SET of each chunk, then GET of each;
         against a Redis Cluster (--redis-url naming any node, or a seed list) redis-py
         RedisCluster clients, one per thread, each command sent to its key's node
  mock   one thread: each chunk copied into fresh memory, then into preallocated shared memory
Each baseline phase runs right after the adapter's phase of the same kind (the sidecar idles
meanwhile), so that the two sides of a ratio see the machine in about the same state.
Each figure is GB/s; `*_vs_baseline` / `vs_baseline` is baseline seconds / adapter seconds (above 1:
the adapter is faster).

Before the timed phases the process's objects are frozen out of the garbage collector (gc.freeze),
so that a full collection of the harness's own heap does not land in one phase of one side.

`mac`: what authenticating the blobs costs, on the same bytes, one thread: keyed BLAKE3 (the MAC
an adapter with `authenticate` signs and checks) against xxh3 (the checksum it replaces on loads),
in GB/s, and the MAC's seconds as a share of the warm load phase (`load_share`: its CPU time, not
necessarily on the critical path: checks of different chunks run in parallel).

Besides the figures: `written` (chunks written behind), each load's `hit_chunks` (chunks
prefetched back), `verified` (the adapter's and the baseline's bytes came back intact), which say
what went wrong when `ok` is false, and for redis `redis_cpu_s`: the CPU seconds the Redis
server's main thread spent in each phase (INFO cpu; other clients of a shared Redis included;
summed over the primaries of a cluster),
which tells the server's share of the time from the client's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.bench.l2_baselines import (
    Baseline,
    DiskBaseline,
    MemoryBaseline,
    RedisBaseline,
    drop_cached,
    gbps,
    is_cluster,
    mac_cost,
    server_cpu_seconds,
)
from app.bench.l2_slab import SETTLE_S
from app.logs import configure_logging
from app.main import Service
from app.settings import Settings
from app.settings_load import load_settings
from engine.facade import CacheEngine
from engine.keys import KVLayout
from engine.results import SlotStatus, StoreSlot
from kvdepot_connector.protocol import encode_tokens
from storage.factory import io_threads
from storage.redis_cluster import Node, node_url, seed_urls


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
        "--settle-s", type=float, default=SETTLE_S,
        help="slab: sync and pause this long before each timed phase (lets a device drain earlier writes)",
    )  # fmt: skip
    p.add_argument(
        "--dir", type=Path, help="directory for the disk adapter and its baseline (default: a temp dir)"
    )


async def _redis_cpu(url: str) -> float:
    """The server's CPU seconds (every primary of a Redis Cluster), read off the loop."""
    return await asyncio.to_thread(server_cpu_seconds, url)


@dataclass
class _Written:
    """One request's tokens, the L1 slots its chunks were written to, and the bytes written."""

    tokens: bytes
    slots: list[StoreSlot]
    payloads: list[bytes]


class _CpuProbe:
    """The server's CPU seconds between marks (nothing without a probe), by the name of the phase
    each mark ends."""

    def __init__(self, read: Callable[[], Awaitable[float]] | None) -> None:
        self._read = read
        self._last = 0.0
        self.phases: dict[str, float] = {}

    async def mark(self, phase: str | None = None) -> None:
        if self._read is None:
            return
        now = await self._read()
        if phase is not None:
            self.phases[phase] = round(now - self._last, 3)
        self._last = now


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
            "data_plane.url": f"ipc://{workdir}/bench.sock", "l2.allowed_roots": [workdir],
            # Filling gigabytes on a busy machine can outlast the default 30 s write lease: a
            # reservation reclaimed before its commit is never written behind.
            "l1.write_lease_s": 3600, "l1.read_lease_s": 3600,
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
        if not all(engine.commit(eid, [s.oid for s in req.slots])):
            raise RuntimeError("a write reservation expired before its commit")
    if not await engine.l2.store.wait_idle(600):
        raise RuntimeError("write-behind did not finish")
    return time.perf_counter() - start, engine.l2.store.counters.written


@dataclass
class _Load:
    """One load phase: seconds, chunks prefetched back, and whether they were the bytes written."""

    seconds: float
    hit_chunks: int
    identical: bool


async def _time_load(engine: CacheEngine, eid: int, requests: list[_Written], phase: str) -> _Load:
    """Look every request up again (L1 is emptied first); seconds until every prefetch is done.
    Then (untimed) the bytes are compared with what was written and the requests released."""
    engine.clear()
    start = time.perf_counter()
    for r, req in enumerate(requests):
        engine.lookup(eid, f"{phase}{r}", req.tokens, "")
    hits = [(await engine.wait_prefetch(eid, f"{phase}{r}")).hit_chunks for r in range(len(requests))]
    seconds = time.perf_counter() - start
    return _Load(seconds, sum(hits), _identical(engine, eid, requests, hits, phase))


@dataclass
class _Run:
    """Both sides' figures: store seconds, chunks written, each load (cold: None where it does
    not apply), the baseline's seconds per phase, and the Redis server's CPU seconds per phase."""

    chunk_bytes: int
    store_s: float
    written: int
    warm: _Load
    cold: _Load | None
    payloads: list[bytes]
    base_s: dict[str, float]
    base_ok: bool
    server_cpu_s: dict[str, float]


def _make_baseline(args: argparse.Namespace, workdir: Path, payloads: list[bytes], threads: int) -> Baseline:
    if args.adapter == "disk":
        return DiskBaseline(workdir / "baseline", payloads, threads)
    if args.adapter == "redis":
        return RedisBaseline(args.redis_url, payloads, threads)
    return MemoryBaseline(payloads)


async def _through_controllers(
    args: argparse.Namespace,
    workdir: Path,
    settings: Settings,
    threads: int,
    server_cpu: Callable[[], Awaitable[float]] | None = None,
) -> _Run:
    """Each phase of the adapter, then the same phase of the baseline (blocking: the sidecar is
    idle meanwhile), so that the two figures of a phase are measured as close together as can be."""
    layout = _layout(args)
    service = Service(settings)
    service.build()
    runner = asyncio.get_running_loop().create_task(service.run())
    baseline: Baseline | None = None
    try:
        await _wait_ready(service)
        engine = service.engine
        assert engine is not None
        eid = engine.register("bench-model", layout).engine_id
        requests = _fill(engine, eid, args)
        payloads = [p for req in requests for p in req.payloads]
        baseline = _make_baseline(args, workdir, payloads, threads)

        # What the process holds by now (torch, the app, the payloads) is moved out of the
        # collector's reach: a full collection over it (~0.1 s) must not land in a timed phase.
        gc.collect()
        gc.freeze()
        cpu = _CpuProbe(server_cpu)
        base_s: dict[str, float] = {}
        await cpu.mark()
        store_s, written = await _time_store(engine, eid, requests)
        await cpu.mark("store")
        base_s["store"] = baseline.store()
        await cpu.mark("baseline_store")
        warm = await _time_load(engine, eid, requests, "warm")
        await cpu.mark("load")
        base_s["load_warm"] = baseline.load_warm()
        await cpu.mark("baseline_load")
        cold = None
        if baseline.cold:
            drop_cached(workdir / "l2")
            baseline.drop()
            cold = await _time_load(engine, eid, requests, "cold")
            base_s["load_cold"] = baseline.load_cold()
        ok = baseline.ok
        return _Run(layout.chunk_bytes, store_s, written, warm, cold, payloads, base_s, ok, cpu.phases)
    finally:
        gc.unfreeze()
        if baseline is not None:
            baseline.close()
        service.request_stop()
        await runner


def _identical(engine: CacheEngine, eid: int, requests: list[_Written], hits: list[int], phase: str) -> bool:
    """Whether every request hit all its chunks and they hold the bytes written. A request that
    hit nothing (its prefetch missed the deadline) holds no read locks: nothing to retrieve."""
    same = True
    for r, (req, hit) in enumerate(zip(requests, hits, strict=True)):
        same = same and hit == len(req.payloads)
        if not hit:
            continue
        extents = engine.retrieve(eid, f"{phase}{r}", 0, hit)
        same = same and all(
            bytes(engine.arena.view(e.offset, e.size)) == p
            for e, p in zip(extents, req.payloads, strict=False)
        )
        engine.release(eid, f"{phase}{r}")
    return same


async def _wait_ready(service: Service) -> None:
    for _ in range(600):
        if not service.not_ready():
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"service not ready: {service.not_ready()}")


def _adapter(args: argparse.Namespace, workdir: Path, prefix: str) -> dict[str, Any]:
    adapters: dict[str, dict[str, Any]] = {
        "disk": {"type": "disk", "name": "disk", "paths": [str(workdir / "l2")], "capacity_gb": 64},
        # A bandwidth figure, not a fault test: on a busy machine Redis may stall past the
        # default 2 s, and a write that gives up is missing from the store figure.
        "redis": {
            "type": "redis",
            "name": "redis",
            "url": args.redis_url,
            "key_prefix": prefix,
            "timeout_s": 30,
        },
        "mock": {"type": "mock", "name": "mock", "capacity_gb": 64},
    }
    return adapters[args.adapter]


_BASELINES = {
    "disk": "{n} threads: open + write + fsync + close per chunk file; open + read per file",
    "redis": "{n} redis-py connections, one per thread: SET / GET per chunk",
    "redis-cluster": "{n} redis-py RedisCluster clients, one per thread: SET / GET per chunk, each "
    "to its key's node",
    "mock": "one thread: a copy of each chunk into fresh memory; copied back into shared memory",
}
def _baseline_kind(args: argparse.Namespace) -> str:
    if args.adapter == "redis" and is_cluster(seed_urls(args.redis_url)[0]):
        return "redis-cluster"
    return str(args.adapter)


_READS = {
    "disk": ("page cache: the files just written", "device: every file dropped from the page cache "
             "(posix_fadvise DONTNEED) after fsync, the adapter's and the baseline's"),
    "redis": ("Redis memory", "not applicable: Redis serves values from its own memory"),
    "mock": ("process memory", "not applicable: the mock holds its blobs in memory"),
}  # fmt: skip


def _load_figures(total: int, reads: str, load: _Load | None, base_s: float | None) -> dict[str, Any]:
    if load is None or base_s is None:
        return {"reads": reads}
    return {"reads": reads, "adapter_gbps": gbps(total, load.seconds), "baseline_gbps": gbps(total, base_s),
            "vs_baseline": round(base_s / load.seconds, 3), "hit_chunks": load.hit_chunks}  # fmt: skip


def _drop_redis_keys(url: str, prefix: str) -> None:
    """The run's keys, deleted from the Redis (from every primary of a Redis Cluster)."""
    import redis

    seed = seed_urls(url)[0]
    if not is_cluster(seed):
        with redis.Redis.from_url(seed) as r:
            for key in r.scan_iter(match=prefix + "*"):
                r.unlink(key)
        return
    with redis.RedisCluster.from_url(seed) as rc:
        for node in rc.get_primaries():
            with redis.Redis.from_url(node_url(seed, Node(node.host, int(node.port)))) as r:
                for key in r.scan_iter(match=prefix + "*"):
                    r.unlink(key)


def _result(args: argparse.Namespace, got: _Run, threads: int) -> dict[str, Any]:
    n_chunks = args.requests * args.chunks_per_request
    total = n_chunks * got.chunk_bytes
    loads = [got.warm] if got.cold is None else [got.warm, got.cold]
    intact = all(x.identical and x.hit_chunks == n_chunks for x in loads)
    verified = {"adapter": intact, "baseline": got.base_ok}
    base = got.base_s
    warm_reads, cold_reads = _READS[args.adapter]
    result: dict[str, Any] = {
        "adapter": args.adapter,
        "threads": threads or None,
        "baseline": _BASELINES[_baseline_kind(args)].format(n=threads),
        "store_gbps": gbps(total, got.store_s),
        "baseline_store_gbps": gbps(total, base["store"]),
        "store_vs_baseline": round(base["store"] / got.store_s, 3),
        "load_warm": _load_figures(total, warm_reads, got.warm, base["load_warm"]),
        "load_cold": _load_figures(total, cold_reads, got.cold, base.get("load_cold")),
        "chunks": n_chunks,
        "chunk_bytes": got.chunk_bytes,
        "written": got.written,
        "verified": verified,
        "ok": got.written == n_chunks and all(verified.values()),
        "mac": mac_cost(got.payloads, got.warm.seconds),
    }
    if got.server_cpu_s:
        result["redis_cpu_s"] = got.server_cpu_s
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
        settings = _settings(args, workdir, _adapter(args, workdir, prefix), _layout(args))
        threads = io_threads(settings.l2.adapters[0])
        configure_logging(settings.logging, sys.stderr)  # stdout carries the result alone
        got = asyncio.run(_through_controllers(args, workdir, settings, threads, probe))
    finally:
        if args.adapter == "redis":
            _drop_redis_keys(args.redis_url, prefix)
        shutil.rmtree(workdir, ignore_errors=True)
    result = _result(args, got, threads)
    print(json.dumps(result))
    return 0 if result["ok"] else 1
