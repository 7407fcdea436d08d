"""Release fences: the sidecar's generation words and a client's read-only view of them."""

from __future__ import annotations

import mmap
import os

import pytest

from engine.keys import Namespace, ObjectKey
from engine.l1.allocator import ExtentAllocator
from engine.l1.cache import L1Cache
from engine.l1.eviction import make_policy
from engine.l1.fences import ReleaseFences
from engine.l1.lifecycle import L1Object
from kvdepot_connector import protocol as p
from kvdepot_connector.fences import Fences

SEG = 1 << 20


def client_view(table: ReleaseFences) -> Fences:
    fd = os.dup(table.readonly_fd)
    try:
        view = Fences.open(fd)
    finally:
        os.close(fd)
    assert view is not None
    return view


def test_an_extent_moves_the_words_of_the_segments_it_spans_and_no_other() -> None:
    table = ReleaseFences(4 * SEG, SEG)
    view = client_view(table)
    try:
        before = table.snapshot([(SEG - 10, 20), (3 * SEG, 5)])  # spans 0 and 1; and 3
        assert [s for s, _ in before] == [0, 1, 3]
        fences = [p.Fence(s, w) for s, w in before]
        assert view.unmoved(fences)
        table.bump_extent(2 * SEG, SEG)  # segment 2 only
        assert view.unmoved(fences)
        table.bump_extent(SEG + 100, 1)  # segment 1
        assert not view.unmoved(fences)
        again = [p.Fence(s, w) for s, w in table.snapshot([(SEG - 10, 20), (3 * SEG, 5)])]
        assert view.unmoved(again)
        table.bump_all()
        assert not view.unmoved(again)
        assert not view.unmoved([])  # no words: ask
        assert not view.unmoved([p.Fence(1 << 20, 0)])  # beyond the table: ask
    finally:
        view.close()
        table.close()


def test_the_offered_descriptor_cannot_be_mapped_writable() -> None:
    table = ReleaseFences(4 * SEG, SEG)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(table.readonly_fd, table.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        table.close()


def test_an_object_leaving_l1_moves_its_segment_before_its_memory_is_free_again() -> None:
    cache = L1Cache(
        ExtentAllocator(4 * SEG, 4096), make_policy("lru"), high_watermark=0.9, low_watermark=0.8,
        write_lease_s=30,
    )  # fmt: skip
    cache.fences = table = ReleaseFences(4 * SEG, SEG)
    try:
        key = ObjectKey(Namespace("m", b"l"), "", b"\x01" * 16)
        obj = cache.try_reserve(key, SEG // 2, 0.0)
        assert isinstance(obj, L1Object)
        ready = cache.commit(obj.oid, 0.0)
        words = table.snapshot([(ready.offset, ready.size)])
        cache.delete(ready)
        assert table.snapshot([(ready.offset, ready.size)]) != words
    finally:
        table.close()
