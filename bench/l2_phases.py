"""The timed phases of `kvdepot bench l2` (bench/l2.py, and the slab's: bench/l2_slab.py) through
the sidecar's own wiring, built in-process: the settings of a run, requests reserved and filled in
L1 with random bytes, committed (write-behind) and timed until the store controller is idle, looked
up again after L1 is cleared and timed until every prefetch is done, then checked byte for byte.

Primitives: bench_settings(args, workdir, adapter, layout) -> Settings; wait_ready(service);
fill(engine, eid, args) -> [Written]; time_store(engine, eid, written) -> (seconds, chunks written);
time_load(engine, eid, written, phase) -> Load; load_rounds(rounds, adapter, sides) -> the best of
alternating rounds of a load phase, the adapter's and each baseline's.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Mapping
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


@dataclass
class Written:
    """One request's tokens, the L1 slots its chunks were written to, and the bytes written."""

    tokens: bytes
    slots: list[StoreSlot]
    payloads: list[bytes]


def layout_of(args: argparse.Namespace) -> KVLayout:
    return KVLayout("float16", args.layers, args.kv_heads, args.head_dim, args.chunk_tokens, "layer-kv",
                    args.chunk_tokens)  # fmt: skip


def bench_settings(
    args: argparse.Namespace, workdir: Path, adapter: dict[str, Any], layout: KVLayout
) -> Settings:
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


def fill(engine: CacheEngine, eid: int, args: argparse.Namespace) -> list[Written]:
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
        requests.append(Written(tokens, slots, [bytes(engine.arena.view(s.offset, s.size)) for s in slots]))
    return requests


async def time_store(engine: CacheEngine, eid: int, requests: list[Written]) -> tuple[float, int]:
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
class Load:
    """One load phase: seconds, chunks prefetched back, and whether they were the bytes written."""

    seconds: float
    hit_chunks: int
    identical: bool


async def time_load(engine: CacheEngine, eid: int, requests: list[Written], phase: str) -> Load:
    """Look every request up again (L1 is emptied first); seconds until every prefetch is done.
    Then (untimed) the bytes are compared with what was written and the requests released."""
    engine.clear()
    start = time.perf_counter()
    for r, req in enumerate(requests):
        engine.lookup(eid, f"{phase}{r}", req.tokens, "")
    hits = [(await engine.wait_prefetch(eid, f"{phase}{r}")).hit_chunks for r in range(len(requests))]
    seconds = time.perf_counter() - start
    return Load(seconds, sum(hits), identical(engine, eid, requests, hits, phase))


async def load_rounds(
    rounds: int, adapter: Callable[[int], Awaitable[Load]], sides: Mapping[str, Callable[[], float]], *,
    before: Callable[[], None] = lambda: None, mark: Callable[[str], Awaitable[None]] | None = None,
) -> tuple[Load, dict[str, float]]:  # fmt: skip
    """One load phase `rounds` times; in each round the adapter's load (`adapter(round)`), then each
    side's (a baseline: its seconds) in order, `before()` ahead of every one (a cold phase drops
    the page cache there) and `mark(name)` after it ("load" for the adapter's). Answers the
    adapter's best round (the shortest; its hits the fewest of any round, identical only if every
    round was) and each side's shortest seconds: on a noisy machine the best of a few alternating
    rounds is the figure that a neighbour's burst does not decide."""
    loads: list[Load] = []
    best = dict.fromkeys(sides, math.inf)
    for r in range(max(1, rounds)):
        before()
        loads.append(await adapter(r))
        if mark is not None:
            await mark("load")
        for name, side in sides.items():
            before()
            best[name] = min(best[name], side())
            if mark is not None:
                await mark(name)
    fastest = min(load.seconds for load in loads)
    hits = min(load.hit_chunks for load in loads)
    return Load(fastest, hits, all(load.identical for load in loads)), best


def identical(engine: CacheEngine, eid: int, requests: list[Written], hits: list[int], phase: str) -> bool:
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


async def wait_ready(service: Service) -> None:
    for _ in range(600):
        if not service.not_ready():
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"service not ready: {service.not_ready()}")
