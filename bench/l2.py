"""`kvdepot bench l2 --adapter disk|slab|redis|mock`: write-behind and prefetch through the
controllers, against a plain baseline of the same bytes at the same concurrency, measured in the
same run. Prints one JSON object. (slab: bench/l2_slab.py, with baselines of its own.)

The sidecar's own wiring is built in-process (no data plane traffic): chunks are reserved and
filled in L1, committed (which queues them for write-behind), and the store figure is the time
until the store controller is idle. Then L1 is cleared and every request is looked up again: a
load figure is the time until the prefetches have put every chunk back into L1, checked byte for
byte afterwards (outside the timing). The disk adapter is loaded twice: `load_warm` right after
the writes (its files are in the page cache), `load_cold` after every file of the adapter was
dropped from the page cache (posix_fadvise DONTNEED); for Redis and the mock a cold read does not
apply (their bytes live in memory), and `load_cold` says so.

Baselines (bench/l2_baselines.py), on the same bytes, with as many threads as the adapter has
I/O threads (`threads`, the config's transfer_threads(): disk `io_threads`, redis the bulk lane's):
  disk   open + write + fsync + close per chunk file; open + read of each file, page-cache and cold
  redis  plain redis-py clients, one connection per thread: SET of each chunk, then GET of each;
         against a Redis Cluster (--redis-url naming any node, or a seed list) redis-py
         RedisCluster clients, one per thread, each command sent to its key's node
  mock   one thread: each chunk copied into fresh memory, then into preallocated shared memory
and for disk a second load baseline, the verify-too one (bench/l2_verify.py): the adapter's own
blob files read at the same concurrency and each put through the check every load runs (the
keyed-BLAKE3 MAC with the deployment's key where the tier authenticates, as by default, else the
xxh3 checksum), since no load may skip it: `verify_baseline_gbps` and `vs_verify_baseline` in
each load figure, `verify_baseline` says what it does.
Each baseline phase runs right after the adapter's phase of the same kind (the sidecar idles
meanwhile), so that the two sides of a ratio see the machine in about the same state. A load
phase runs `--rounds` times (default 5), the adapter and each baseline in turn in every round
(for a cold one, every file dropped from the page cache before each side), and each side's
figure is its best round: on a noisy machine a neighbour's burst then decides no ratio.
Each figure is GB/s; `*_vs_baseline` / `vs_baseline` is baseline seconds / adapter seconds (above 1:
the adapter is faster).

Before the timed phases the process's objects are frozen out of the garbage collector (gc.freeze),
so that a full collection of the harness's own heap does not land in one phase of one side.

`mac`: what authenticating the blobs costs, on the same bytes, one thread: keyed BLAKE3 (the MAC
an adapter with `authenticate` signs and checks) against xxh3 (the checksum it replaces on loads),
in GB/s, and the MAC's seconds as a share of the warm load phase (`load_share`: its CPU time, not
necessarily on the critical path: checks of different chunks run in parallel).

Besides the figures: `written` (chunks written behind), each load's `hit_chunks` (chunks
prefetched back, in the fewest of its rounds), `verified` (the adapter's and each baseline's bytes
came back intact, in every round), which say what went wrong when `ok` is false, and for redis
`redis_cpu_s`: the CPU seconds the Redis server's main thread spent in each phase (INFO cpu; other
clients of a shared Redis included; summed over the primaries of a cluster; a load phase's, the
mean of its rounds), which tells the server's share of the time from the client's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import shutil
import sys
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.logs import configure_logging
from app.main import Service
from app.settings import Settings
from bench.l2_baselines import (
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
from bench.l2_phases import (
    Load,
    bench_settings,
    fill,
    layout_of,
    load_rounds,
    time_load,
    time_store,
    wait_ready,
)
from bench.l2_slab import SETTLE_S
from bench.l2_verify import BlobFile, VerifyBaseline
from engine.facade import CacheEngine
from storage.auth import KEY_FILE, BlobKeys
from storage.disk.adapter import DiskAdapter
from storage.redis.cluster import Node, node_url, seed_urls


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
        "--rounds", type=int, default=5,
        help="load phases: rounds of the adapter and each baseline in turn; each figure is its best round",
    )  # fmt: skip
    p.add_argument(
        "--dir", type=Path, help="directory for the disk adapter and its baseline (default: a temp dir)"
    )


async def _redis_cpu(url: str) -> float:
    """The server's CPU seconds (every primary of a Redis Cluster), read off the loop."""
    return await asyncio.to_thread(server_cpu_seconds, url)


class _CpuProbe:
    """The server's CPU seconds between marks (nothing without a probe), by the name of the phase
    each mark ends: per phase, the mean over the times it ran (load phases: once per round)."""

    def __init__(self, read: Callable[[], Awaitable[float]] | None) -> None:
        self._read = read
        self._last = 0.0
        self._seen: dict[str, list[float]] = {}

    @property
    def phases(self) -> dict[str, float]:
        return {phase: round(sum(s) / len(s), 3) for phase, s in self._seen.items()}

    async def mark(self, phase: str | None = None) -> None:
        if self._read is None:
            return
        now = await self._read()
        if phase is not None:
            self._seen.setdefault(phase, []).append(now - self._last)
        self._last = now


@dataclass
class _Run:
    """Both sides' figures: store seconds, chunks written, each load (cold: None where it does
    not apply), the baseline's seconds per phase, and the Redis server's CPU seconds per phase."""

    chunk_bytes: int
    store_s: float
    written: int
    warm: Load
    cold: Load | None
    payloads: list[bytes]
    base_s: dict[str, float]
    base_ok: bool
    server_cpu_s: dict[str, float]
    verify_s: dict[str, float]
    verify_ok: bool | None
    verify_check: str


def _make_baseline(args: argparse.Namespace, workdir: Path, payloads: list[bytes], threads: int) -> Baseline:
    if args.adapter == "disk":
        return DiskBaseline(workdir / "baseline", payloads, threads)
    if args.adapter == "redis":
        return RedisBaseline(args.redis_url, payloads, threads)
    return MemoryBaseline(payloads)


def _verify_baseline(
    settings: Settings, engine: CacheEngine, eid: int, payloads: list[bytes], threads: int
) -> VerifyBaseline | None:
    """The verify-too baseline over the disk adapter's blob files (None for other adapters), with
    the check a load runs: the deployment's keys (the key file the service made, or the configured
    secrets) where the tier authenticates, else none (xxh3)."""
    assert engine.l2 is not None
    tier = engine.l2.tiers.active()[0]
    adapter = tier.adapter
    if not isinstance(adapter, DiskAdapter):
        return None
    blobs = [BlobFile(key, path) for key in adapter.keys_lru() if (path := adapter.path_of(key))]
    keys = None
    if tier.config.authenticate:
        secrets = [k.get_secret_value() for k in settings.l2.auth_keys]
        keys = BlobKeys.from_settings(secrets, settings.data_dir / KEY_FILE)
    layout_fp = engine.registration(eid).namespace.layout_fp
    return VerifyBaseline(blobs, payloads, layout_fp, keys, threads)


async def _through_controllers(
    args: argparse.Namespace,
    workdir: Path,
    settings: Settings,
    threads: int,
    server_cpu: Callable[[], Awaitable[float]] | None = None,
) -> _Run:
    """Each phase of the adapter, then the same phase of the baseline (blocking: the sidecar is
    idle meanwhile), so that the two figures of a phase are measured as close together as can be."""
    layout = layout_of(args)
    service = Service(settings)
    service.build()
    runner = asyncio.get_running_loop().create_task(service.run())
    baseline: Baseline | None = None
    verify: VerifyBaseline | None = None
    try:
        await wait_ready(service)
        engine = service.engine
        assert engine is not None
        eid = engine.register("bench-model", layout).engine_id
        requests = fill(engine, eid, args)
        payloads = [p for req in requests for p in req.payloads]
        baseline = _make_baseline(args, workdir, payloads, threads)

        # What the process holds by now (torch, the app, the payloads) is moved out of the
        # collector's reach: a full collection over it (~0.1 s) must not land in a timed phase.
        gc.collect()
        gc.freeze()
        cpu = _CpuProbe(server_cpu)
        base_s: dict[str, float] = {}
        await cpu.mark()
        store_s, written = await time_store(engine, eid, requests)
        await cpu.mark("store")
        base_s["store"] = baseline.store()
        await cpu.mark("baseline_store")
        verify = _verify_baseline(settings, engine, eid, payloads, threads)
        sides: dict[str, Callable[[], float]] = {"baseline_load": baseline.load_warm}
        if verify is not None:
            sides["verify_load"] = verify.load
        warm, best = await load_rounds(
            args.rounds, lambda r: time_load(engine, eid, requests, f"warm{r}-"), sides, mark=cpu.mark
        )
        base_s["load_warm"] = best["baseline_load"]
        verify_s = {"load_warm": best["verify_load"]} if verify is not None else {}
        cold = None
        if baseline.cold:  # every file, the adapter's and the baselines', dropped before each side
            sides["baseline_load"] = baseline.load_cold
            cold, best = await load_rounds(
                args.rounds, lambda r: time_load(engine, eid, requests, f"cold{r}-"), sides,
                before=lambda: drop_cached(workdir),
            )  # fmt: skip
            base_s["load_cold"] = best["baseline_load"]
            if verify is not None:
                verify_s["load_cold"] = best["verify_load"]
        ok = baseline.ok
        verify_ok, check = (None, "") if verify is None else (verify.ok, verify.check)
        return _Run(layout.chunk_bytes, store_s, written, warm, cold, payloads, base_s, ok, cpu.phases,
                    verify_s, verify_ok, check)  # fmt: skip
    finally:
        gc.unfreeze()
        if baseline is not None:
            baseline.close()
        if verify is not None:
            verify.close()
        service.request_stop()
        await runner


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


_VERIFY_BASELINE = ("{n} threads over the adapter's own blob files: open + one preadv (header apart, payload "
                    "into shared memory) per file, then the codec's check of the blob: {check}")  # fmt: skip


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


def _load_figures(
    total: int, reads: str, load: Load | None, base_s: float | None, verify_s: float | None
) -> dict[str, Any]:
    if load is None or base_s is None:
        return {"reads": reads}
    figures = {"reads": reads, "adapter_gbps": gbps(total, load.seconds),
               "baseline_gbps": gbps(total, base_s), "vs_baseline": round(base_s / load.seconds, 3),
               "hit_chunks": load.hit_chunks}  # fmt: skip
    if verify_s is not None:
        figures["verify_baseline_gbps"] = gbps(total, verify_s)
        figures["vs_verify_baseline"] = round(verify_s / load.seconds, 3)
    return figures


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
    if got.verify_ok is not None:
        verified["verify_baseline"] = got.verify_ok
    base, verify = got.base_s, got.verify_s
    warm_reads, cold_reads = _READS[args.adapter]
    cold_base = base.get("load_cold")
    result: dict[str, Any] = {
        "adapter": args.adapter,
        "threads": threads or None,
        "baseline": _BASELINES[_baseline_kind(args)].format(n=threads),
        "store_gbps": gbps(total, got.store_s),
        "baseline_store_gbps": gbps(total, base["store"]),
        "store_vs_baseline": round(base["store"] / got.store_s, 3),
        "load_warm": _load_figures(total, warm_reads, got.warm, base["load_warm"], verify.get("load_warm")),
        "load_cold": _load_figures(total, cold_reads, got.cold, cold_base, verify.get("load_cold")),
        "chunks": n_chunks,
        "chunk_bytes": got.chunk_bytes,
        "written": got.written,
        "verified": verified,
        "ok": got.written == n_chunks and all(verified.values()),
        "mac": mac_cost(got.payloads, got.warm.seconds),
    }
    if got.verify_ok is not None:
        result["verify_baseline"] = _VERIFY_BASELINE.format(n=threads, check=got.verify_check)
    if got.server_cpu_s:
        result["redis_cpu_s"] = got.server_cpu_s
    return result


def run(args: argparse.Namespace) -> int:
    if args.adapter == "slab":  # its own baselines (raw O_DIRECT, the disk adapter): bench/l2_slab.py
        from bench.l2_slab import run_slab

        slab = run_slab(args)
        print(json.dumps(slab))
        return 0 if slab["ok"] and slab["disk_ok"] else 1
    workdir = Path(tempfile.mkdtemp(prefix="kvdepot-bench-l2-", dir=args.dir))
    prefix = f"kvdepot-bench-{uuid.uuid4().hex[:8]}:"
    url = args.redis_url
    probe = (lambda: _redis_cpu(url)) if args.adapter == "redis" else None
    try:
        settings = bench_settings(args, workdir, _adapter(args, workdir, prefix), layout_of(args))
        threads = settings.l2.adapters[0].transfer_threads()
        configure_logging(settings.logging, sys.stderr)  # stdout carries the result alone
        got = asyncio.run(_through_controllers(args, workdir, settings, threads, probe))
    finally:
        if args.adapter == "redis":
            _drop_redis_keys(args.redis_url, prefix)
        shutil.rmtree(workdir, ignore_errors=True)
    result = _result(args, got, threads)
    print(json.dumps(result))
    return 0 if result["ok"] else 1
