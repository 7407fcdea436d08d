"""The cost of prefix pins where L1 chooses victims: a STORE that must evict, with N pinned chunks
sitting at the head of the LRU order, against the same STORE with no pin, in the same run.

    PYTHONPATH=.:connector .venv/bin/python tests/unit/engine/bench_pins.py [--stores 3000]

Prints one JSON line per N: microseconds per evicting one-chunk STORE + COMMIT (the best of three
rounds, alternating with the baseline, because this machine is noisy) and the ratio to the
baseline. Scans that pass over pinned chunks hand them to the policy as accessed
(engine/l1/room.py), so the ratio should stay near 1 whatever N is; without that, every eviction
would walk past all N.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import struct
import time

from engine.facade import CacheEngine
from engine.pins.config import PinSettings
from engine.pins.service import PinService
from engine.results import SlotStatus
from tests.factories import engine, small_layout

CHUNK, PAGE, PAGES = 16, 4096, 8192


def ids(which: int, chunks: int) -> list[int]:
    return list(range(which * 1000, which * 1000 + chunks * CHUNK))


def store(eng: CacheEngine, eid: int, tokens: list[int], salt: str) -> None:
    slots = eng.store(eid, "w", struct.pack(f"<{len(tokens)}I", *tokens), salt)
    eng.commit(eid, [s.oid for s in slots if s.status is SlotStatus.RESERVED])


async def per_store_us(pinned: int, stores: int) -> float:
    with engine(PAGES * PAGE, chunk_size=CHUNK) as (eng, clock):
        eid = eng.register("m", small_layout()).engine_id
        pins = PinService(eng, PinSettings(max_chunks=1 << 16, max_share=1.0), clock=clock)
        if pinned:
            store(eng, eid, ids(1, pinned), "a")
            await pins.put("a", "m", ids(1, pinned), None, ["l1"])
        for i in range(PAGES):  # L1 full: every later store evicts
            store(eng, eid, ids(10 + i, 1), "b")
        started = time.perf_counter()
        for i in range(stores):
            store(eng, eid, ids(2_000_000 + i, 1), "c")
        return (time.perf_counter() - started) / stores * 1e6


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stores", type=int, default=3000)
    args = parser.parse_args()
    for pinned in (1000, 4000):
        base, measured = [], []
        for _ in range(3):
            base.append(await per_store_us(0, args.stores))
            measured.append(await per_store_us(pinned, args.stores))
        print(json.dumps({
            "pinned_chunks": pinned, "us_per_evicting_store": round(min(measured), 1),
            "baseline_us": round(min(base), 1), "ratio": round(min(measured) / min(base), 2),
        }))  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
