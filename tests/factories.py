"""Tiny factories for real engine objects (no mocks): an arena in /dev/shm, an L1 cache, an engine."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from engine.facade import CacheEngine
from engine.keys import KVLayout, Namespace, ObjectKey, TokenHasher
from engine.l1.allocator import ExtentAllocator
from engine.l1.arena import SharedArena
from engine.l1.cache import L1Cache
from engine.l1.eviction import LRUPolicy


@dataclass
class FakeClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def small_layout(chunk_size: int = 16, num_layers: int = 2, head_dim: int = 32) -> KVLayout:
    """A layout whose chunk is 2*layers*heads*head_dim*chunk*2 bytes (4 KiB by default)."""
    return KVLayout(
        dtype="float16", num_layers=num_layers, num_kv_heads=1, head_dim=head_dim, block_size=chunk_size,
        kind="test", chunk_size=chunk_size,
    )  # fmt: skip


def key(n: int, salt: str = "") -> ObjectKey:
    return ObjectKey(Namespace("model", b"\x00" * 8), salt, n.to_bytes(32, "little"))


def tokens(n: int, start: int = 0) -> bytes:
    return TokenHasher.encode_tokens(list(range(start, start + n)))


@contextmanager
def arena(size: int) -> Iterator[SharedArena]:
    a = SharedArena.create(size, f"test{uuid.uuid4().hex[:8]}", populate=False)
    try:
        yield a
    finally:
        a.close()


def make_cache(capacity: int, *, alignment: int = 4096, high: float = 1.0, low: float = 1.0) -> L1Cache:
    return L1Cache(
        ExtentAllocator(capacity, alignment), LRUPolicy(), high_watermark=high, low_watermark=low,
        write_lease_s=10.0,
    )  # fmt: skip


@contextmanager
def engine(
    capacity: int, *, chunk_size: int = 16, read_lease_s: float = 20.0, write_lease_s: float = 10.0,
    high: float = 1.0, low: float = 1.0,
) -> Iterator[tuple[CacheEngine, FakeClock]]:  # fmt: skip
    clock = FakeClock()
    with arena(capacity) as a:
        cache = L1Cache(
            ExtentAllocator(a.size, 4096), LRUPolicy(), high_watermark=high, low_watermark=low,
            write_lease_s=write_lease_s,
        )  # fmt: skip
        yield (
            CacheEngine(arena=a, cache=cache, chunk_size=chunk_size, read_lease_s=read_lease_s, clock=clock),
            clock,
        )
