"""Write domains in L1: each writer's objects in its own segments, segments zeroed between
domains, the sidecar's share kept, a gone instance's segments free once its processes exited."""

from __future__ import annotations

import subprocess
import sys

from engine.keys import Namespace, ObjectKey
from engine.l1.allocator import ExtentAllocator
from engine.l1.cache import L1Cache, Refusal
from engine.l1.domains import AHEAD_OBJECTS, SIDECAR, WriteDomains
from engine.l1.eviction import make_policy
from engine.l1.lifecycle import L1Object

PAGE = 4096
SEG = 4 * PAGE
NS = Namespace("m", "l", 0)


def key(i: int) -> ObjectKey:
    return ObjectKey(NS, "t", i.to_bytes(32, "big"))


def make(segments: int = 4, reserve: int = 0) -> tuple[L1Cache, WriteDomains, list[tuple[int, int]]]:
    zeroed: list[tuple[int, int]] = []
    domains = WriteDomains(segments * SEG, SEG, zero=lambda o, n: zeroed.append((o, n)), reserve=reserve)
    cache = L1Cache(
        ExtentAllocator(segments * SEG, PAGE), make_policy("lru"), high_watermark=1.0, low_watermark=1.0,
        write_lease_s=10, domains=domains,
    )  # fmt: skip
    return cache, domains, zeroed


def reserve(cache: L1Cache, i: int, owner: str, size: int = PAGE) -> L1Object:
    got = cache.try_reserve(key(i), size, 0.0, owner=owner, holder=1 if owner else 0)
    assert isinstance(got, L1Object)
    return got


def test_each_writer_gets_its_own_segments_and_is_granted_them() -> None:
    cache, domains, _ = make()
    grants: list[tuple[str, int]] = []
    domains.on_grant = lambda inst, i: grants.append((inst, i))
    a = [reserve(cache, i, "a") for i in range(5)]  # one segment and a page of a second
    b = reserve(cache, 10, "b")
    s = reserve(cache, 20, SIDECAR)
    seg = {o.oid: o.offset // SEG for o in [*a, b, s]}
    assert {seg[o.oid] for o in a} == {0, 1}
    assert seg[b.oid] == 2 and seg[s.oid] == 3
    assert grants == [("a", 0), ("a", 1), ("b", 2)]  # the sidecar's own segment goes to no client
    assert domains.writable("a") == [0, 1] and domains.writable(SIDECAR) == []
    cache.allocator.check()


def test_a_writer_out_of_room_evicts_its_own_never_anothers() -> None:
    cache, _, _ = make(segments=2)
    for i in range(4):
        cache.commit(reserve(cache, i, "a").oid, 0.0)  # fills segment 0
    for i in range(4):
        cache.commit(reserve(cache, 10 + i, "b").oid, 0.0)  # fills segment 1
    c = cache.try_reserve(key(30), PAGE, 0.0, owner="c", holder=3)
    assert c is Refusal.NO_SPACE  # nothing of a or b may be evicted for c: it could not write there
    assert len(cache) == 8
    got = reserve(cache, 40, "a")  # a evicts its own least recent
    assert got.offset // SEG == 0 and cache.peek(key(0)) is None and cache.peek(key(10)) is not None


def test_a_sidecar_segment_handed_to_an_engine_is_zeroed_first() -> None:
    cache, domains, zeroed = make(segments=2)
    s = reserve(cache, 1, SIDECAR)
    cache.abort(s)
    cache.commit(reserve(cache, 2, "a").oid, 0.0)  # the free segment 1
    got = reserve(cache, 3, "a", size=SEG)  # a whole segment: only the sidecar's empty one is left
    assert got.offset == 0 and domains.owner[0] == "a"
    assert zeroed == [(0, SEG)]


def test_engines_leave_the_sidecar_its_reserve() -> None:
    cache, _, _ = make(segments=2, reserve=1)
    reserve(cache, 1, "a", size=SEG)
    assert cache.try_reserve(key(2), PAGE, 0.0, owner="b", holder=2) is Refusal.NO_SPACE
    assert reserve(cache, 3, SIDECAR).offset // SEG == 1


def test_a_gone_instances_segments_are_freed_once_its_processes_exited() -> None:
    cache, domains, zeroed = make(segments=2)
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        domains.note_process("a", proc.pid)
        cache.commit(reserve(cache, 1, "a", size=SEG).oid, 0.0)
        reserve(cache, 2, "b", size=SEG)
        domains.gone("a")
        # Its process lives (it may still write through its mapping): its segment is not reused.
        assert cache.try_reserve(key(3), PAGE, 0.0, owner="c", holder=3) is Refusal.NO_SPACE
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
    got = reserve(cache, 4, "c")  # exited: a's chunk is evicted, its segment zeroed and handed on
    assert got.offset // SEG == 0 and domains.owner[0] == "c" and zeroed == [(0, SEG)]
    assert cache.peek(key(1)) is None
    cache.allocator.check()


def test_an_engine_evicts_none_of_the_sidecars_chunks_it_could_not_take() -> None:
    cache, _, _ = make(segments=2, reserve=1)
    cache.commit(reserve(cache, 1, SIDECAR).oid, 0.0)  # an L2 load, waiting for its reader
    for i in range(4):
        cache.commit(reserve(cache, 10 + i, "a").oid, 0.0)  # fills a's one segment
    reserve(cache, 20, "a")  # room from a's own chunks
    assert cache.peek(key(1)) is not None and cache.peek(key(10)) is None


def test_a_chunk_larger_than_a_segment_spans_consecutive_ones_of_its_domain() -> None:
    cache, domains, _ = make(segments=4)
    grants: list[tuple[str, int]] = []
    domains.on_grant = lambda inst, i: grants.append((inst, i))
    reserve(cache, 1, "b")  # segment 0
    big = reserve(cache, 2, "a", size=2 * SEG)
    assert big.offset == SEG and grants == [("b", 0), ("a", 1), ("a", 2)]
    assert domains.used == [PAGE, SEG, SEG, 0]
    cache.abort(big)
    assert domains.used == [PAGE, 0, 0, 0] and domains.owner[1:3] == ["a", "a"]
    cache.allocator.check()


def test_a_process_is_watched_once_and_an_instance_that_never_wrote_is_forgotten() -> None:
    import os

    _, domains, _ = make()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):  # a long-lived engine process reconnecting its lifeline
        domains.note_process("a", os.getpid())
    assert len(os.listdir("/proc/self/fd")) == before + 1
    domains.gone("a")  # it never wrote: nothing to wait for
    assert len(os.listdir("/proc/self/fd")) == before


def test_an_l2_load_overflows_into_the_asking_engines_domain_only() -> None:
    cache, domains, _ = make(segments=3, reserve=1)
    for i in range(4):
        cache.commit(reserve(cache, i, "a").oid, 0.0)  # a fills segment 0
    for i in range(4):
        cache.commit(reserve(cache, 20 + i, "b").oid, 0.0)  # b fills segment 1 (2 is the reserve)
    for i in range(4):  # the sidecar's L2 loads fill its reserve, and are being read
        cache.commit(reserve(cache, 10 + i, SIDECAR).oid, 0.0)
        found = cache.find(key(10 + i), 0.0)
        assert found is not None
        cache.lock(found, 0.0)
    # No room in the sidecar's segments: a load for a's request lands in a's domain (evicting a's
    # own least recent), never in b's, and without the overflow it finds no room.
    assert cache.try_reserve(key(51), PAGE, 0.0, temporary=True) is Refusal.NO_SPACE
    got = cache.try_reserve(key(50), PAGE, 0.0, temporary=True, overflow="a")
    assert isinstance(got, L1Object) and domains.owner[got.offset // SEG] == "a"
    assert cache.peek(key(0)) is None and all(cache.peek(key(20 + i)) is not None for i in range(4))
    cache.allocator.check()


def test_a_writer_starting_a_segment_is_granted_its_next_one_ahead_and_only_one() -> None:
    big = AHEAD_OBJECTS * PAGE  # segments of 16 one-page objects: worth mapping ahead
    domains = WriteDomains(16 * big, big, zero=lambda o, n: None)
    cache = L1Cache(
        ExtentAllocator(16 * big, PAGE), make_policy("lru"), high_watermark=1.0, low_watermark=1.0,
        write_lease_s=10, domains=domains,
    )  # fmt: skip
    grants: list[tuple[str, int]] = []
    domains.on_grant = lambda inst, i: grants.append((inst, i))
    reserve(cache, 0, "a")  # starts segment 0: 1 comes ahead
    assert grants == [("a", 0), ("a", 1)]
    for i in range(1, AHEAD_OBJECTS):
        reserve(cache, i, "a")  # fills segment 0: nothing more
    assert grants == [("a", 0), ("a", 1)]
    reserve(cache, 100, "a")  # starts 1 (granted ahead): 2 comes ahead
    assert grants[-1] == ("a", 2) and len(grants) == 3 and domains.counters.ahead == 2
    reserve(cache, 101, "b", size=2 * PAGE)  # 8 objects a segment: b's segments are not worth it
    assert grants[-1] == ("b", 3)
    # Ahead claims stop where a quarter of the segments would no longer be free.
    for i in range(200, 200 + 16 * AHEAD_OBJECTS):
        if not isinstance(cache.try_reserve(key(i), PAGE, 0.0, owner="a", holder=1), L1Object):
            break
    assert sum(1 for i in domains.mine("a") if domains.used[i] == 0) <= 1
    assert domains.counters.ahead < 16 - 16 // 4
    cache.allocator.check()


def test_a_gone_instances_segment_is_zeroed_in_the_scrubbers_thread_and_never_written_meanwhile() -> None:
    import threading
    from concurrent.futures import ThreadPoolExecutor

    started, release = threading.Event(), threading.Event()
    zeroed: list[tuple[int, int]] = []

    def slow_zero(offset: int, size: int) -> None:
        started.set()
        assert release.wait(10)
        zeroed.append((offset, size))

    scrubber = ThreadPoolExecutor(1)
    try:
        domains = WriteDomains(2 * SEG, SEG, zero=slow_zero, scrubber=scrubber)
        cache = L1Cache(
            ExtentAllocator(2 * SEG, PAGE), make_policy("lru"), high_watermark=1.0, low_watermark=1.0,
            write_lease_s=10, domains=domains,
        )  # fmt: skip
        a = reserve(cache, 1, "a", size=SEG)  # segment 0
        cache.abort(a)
        domains.gone("a")  # no process of a's is known: its segment is free now, zeroed in the thread
        assert started.wait(10) and domains.owner[0] is None and 0 in domains.scrubbing
        b = reserve(cache, 2, "b")  # a clean free segment is there: b takes it, not the one being zeroed
        assert b.offset // SEG == 1 and zeroed == []
        waited: list[L1Object | Refusal] = []
        claim = threading.Thread(target=lambda: waited.append(cache.try_reserve(
            key(3), SEG, 0.0, owner="c", holder=3)))  # fmt: skip
        claim.start()
        claim.join(0.2)
        assert claim.is_alive() and zeroed == []  # c needs segment 0: it waits for the zeroing
        release.set()
        claim.join(10)
        got = waited[0]
        assert isinstance(got, L1Object) and got.offset == 0 and zeroed == [(0, SEG)]
        assert domains.counters.scrub_waits == 1 and domains.counters.scrubbed == 1
    finally:
        release.set()
        scrubber.shutdown(wait=True)
