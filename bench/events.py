"""`kvdepot bench events`: what the event bus costs the hot path, and that a flood never blocks it.

One JSON object:
- `enabled` / `disabled`: `--cycles` store + commit + lookup + release cycles of `--chunks` new
  chunks each, through an engine wired as the sidecar wires it (arena, L1 with LRU eviction once
  full, no L2), with the bus enabled (its dispatcher running as a task with a subscriber that
  counts, as in the sidecar) and disabled. Per cycle p50 and p99 (µs), and the total wall time of
  all cycles including the dispatcher's share of the loop. Rounds alternate the engines, so the
  machine's noise falls on all. `ratio_*` = enabled / disabled: the baseline is the same
  engine with publishing off, measured in the same run.
- `flood`: a bus of `--capacity` with no dispatcher draining it is sent `--flood` events: every
  publish's latency (max, p99, ns), then `queued` (must equal the capacity), `dropped` (must equal
  flood - capacity), the same loop's maximum around a call that does nothing (`baseline_max_ns`:
  what a shared machine's preemptions alone put in a maximum), and the same cycles run against an
  engine whose bus is full (every event it publishes is dropped): their p50 against the disabled
  engine's (`full_queue_ratio_p50`).
`ok`: the flood's figures are exact.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from app.logs import configure_logging
from app.settings import L1Settings, LoggingSettings
from app.wiring import build_cache, build_engine
from engine.events import Event, EventBus, Kind
from engine.facade import CacheEngine
from engine.keys import KVLayout
from engine.l1.arena import SealedArena
from engine.results import SlotStatus

CHUNK = 16
LAYOUT = KVLayout(
    dtype="float16", num_layers=2, num_kv_heads=1, head_dim=32, block_size=CHUNK, kind="bench",
    chunk_size=CHUNK,
)  # fmt: skip
"""A chunk of 4 KiB: the bookkeeping is measured, not memory bandwidth."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cycles", type=int, default=6000, help="store+lookup cycles per engine")
    p.add_argument("--chunks", type=int, default=4, help="new chunks stored (and looked up) per cycle")
    p.add_argument("--rounds", type=int, default=6, help="the cycles are run in this many alternating rounds")
    p.add_argument("--flood", type=int, default=100_000, help="events published with no dispatcher")
    p.add_argument("--capacity", type=int, default=65536, help="the bus's queue (events.capacity)")
    p.add_argument("--arena-mb", type=int, default=16, help="L1 size (LRU eviction once full)")


@contextmanager
def _engine(bus: EventBus, arena_bytes: int) -> Iterator[tuple[CacheEngine, int]]:
    l1 = L1Settings(chunk_size=CHUNK, high_watermark=0.9, low_watermark=0.8, max_request_share=1.0)
    arena = SealedArena.create_sealed(arena_bytes, f"bench-events-{id(bus):x}", populate=False)
    try:
        cache = build_cache(l1, arena.size, events=bus)
        eng = build_engine(l1, arena=arena, cache=cache)
        yield eng, eng.register("bench", LAYOUT).engine_id
    finally:
        arena.close()


class _Tokens:
    """Distinct token sequences, so every cycle stores new chunks."""

    def __init__(self, chunks: int) -> None:
        self.n = 0
        self.chunks = chunks

    def next(self) -> bytes:
        self.n += 1
        base = self.n * self.chunks * CHUNK
        return b"".join((base + i).to_bytes(4, "little") for i in range(self.chunks * CHUNK))


def _cycle(eng: CacheEngine, eid: int, toks: bytes, i: int) -> int:
    """One store + commit + lookup + release; answers its duration in ns."""
    start = time.perf_counter_ns()
    slots = eng.store(eid, f"w{i}", toks, "")
    eng.commit(eid, [s.oid for s in slots if s.status is SlotStatus.RESERVED])
    eng.lookup(eid, f"r{i}", toks, "")
    eng.release(eid, f"r{i}")
    return time.perf_counter_ns() - start


async def _run_cycles(eng: CacheEngine, eid: int, tokens: list[bytes], out: list[int]) -> int:
    """The cycles, yielding to the loop (and so to the bus's dispatcher) after each; total ns."""
    start = time.perf_counter_ns()
    for i, toks in enumerate(tokens):
        out.append(_cycle(eng, eid, toks, i))
        await asyncio.sleep(0)
    return time.perf_counter_ns() - start


def _figures(samples: list[int], total_ns: int) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_us": round(ordered[len(ordered) // 2] / 1000, 2),
        "p99_us": round(ordered[min(len(ordered) - 1, len(ordered) * 99 // 100)] / 1000, 2),
        "total_s": round(total_ns / 1e9, 4),
    }


def _noop(_kind: Kind, **_fields: object) -> None:
    return None


def _flood(n: int, capacity: int) -> dict[str, Any]:
    """`n` events into a bus of `capacity` that nobody drains: every publish timed; then the same
    loop timing a call that does nothing (`baseline_max_ns`: what the machine's scheduling alone
    puts into a maximum)."""
    bus = EventBus(capacity=capacity)
    worst = 0
    lat: list[int] = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        bus.emit(Kind.LOOKUP, op="flood", detail=i)
        took = time.perf_counter_ns() - t0
        lat.append(took)
        worst = max(worst, took)
    lat.sort()
    base = 0
    for i in range(n):
        t0 = time.perf_counter_ns()
        _noop(Kind.LOOKUP, op="flood", detail=i)
        base = max(base, time.perf_counter_ns() - t0)
    return {
        "baseline_max_ns": base,
        "attempted": n, "capacity": capacity, "published": bus.published, "queued": bus.pending(),
        "dropped": bus.dropped, "expected_dropped": max(n - capacity, 0), "max_publish_ns": worst,
        "p99_publish_ns": lat[min(n - 1, n * 99 // 100)] if n else 0,
        "p50_publish_ns": lat[n // 2] if n else 0,
    }  # fmt: skip


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    arena = args.arena_mb << 20
    on = EventBus(capacity=args.capacity, linger_s=0.0)
    delivered = 0

    def count(events: list[Event]) -> None:
        nonlocal delivered
        delivered += len(events)

    on.subscribe(count)
    off = EventBus(enabled=False)
    full = EventBus(capacity=1)
    full.emit(Kind.LOOKUP)  # full from now on: everything the engine publishes is dropped
    samples: dict[str, list[int]] = {"enabled": [], "disabled": [], "full": []}
    totals = dict.fromkeys(samples, 0)
    per_round = max(args.cycles // args.rounds, 1)
    dispatcher = asyncio.get_running_loop().create_task(on.run(), name="events")
    try:
        with _engine(on, arena) as e_on, _engine(off, arena) as e_off, _engine(full, arena) as e_full:
            engines = {"enabled": e_on, "disabled": e_off, "full": e_full}
            gen = _Tokens(args.chunks)
            for r in range(args.rounds):
                tokens = [gen.next() for _ in range(per_round)]
                order = list(engines) if r % 2 == 0 else list(reversed(engines))
                for name in order:
                    eng, eid = engines[name]
                    totals[name] += await _run_cycles(eng, eid, tokens, samples[name])
    finally:
        on.stop()
        await dispatcher
    on.flush()
    enabled = _figures(samples["enabled"], totals["enabled"])
    disabled = _figures(samples["disabled"], totals["disabled"])
    full_q = _figures(samples["full"], totals["full"])
    enabled.update(events=on.published, dropped=on.dropped, delivered=delivered)
    flood = _flood(args.flood, args.capacity)
    flood.update(
        full_queue_cycle_p50_us=full_q["p50_us"],
        full_queue_cycle_p99_us=full_q["p99_us"],
        full_queue_ratio_p50=round(full_q["p50_us"] / disabled["p50_us"], 3),
        full_queue_engine_dropped=full.dropped,
    )
    ok = flood["queued"] == min(args.flood, args.capacity) and flood["dropped"] == flood["expected_dropped"]
    return {
        "bench": "events", "cycles": per_round * args.rounds, "chunks_per_cycle": args.chunks,
        "cycle": "store + commit + lookup + release (engine facade, in process)",
        "enabled": enabled, "disabled": disabled,
        "ratio_p50": round(enabled["p50_us"] / disabled["p50_us"], 3),
        "ratio_p99": round(enabled["p99_us"] / disabled["p99_us"], 3),
        "ratio_total": round(enabled["total_s"] / disabled["total_s"], 3),
        "events_per_cycle": round(on.published / max(per_round * args.rounds, 1), 2),
        "flood": flood, "ok": ok,
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    for name in ("cycles", "chunks", "rounds", "capacity", "arena_mb"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    if args.flood < 0:
        raise SystemExit("--flood must not be negative")
    configure_logging(LoggingSettings(level="warning"), sys.stderr)  # stdout carries the result alone
    result = asyncio.run(_measure(args))
    print(json.dumps(result))
    return 0 if result["ok"] else 1
