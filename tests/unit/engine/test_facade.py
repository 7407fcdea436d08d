from __future__ import annotations

import pytest

from app.errors import InvalidInput, NotFound, NotRegistered
from engine.results import SlotStatus
from tests.factories import engine, small_layout, tokens

CHUNK = 16  # tokens per chunk in these tests; a chunk is 4 KiB


def store_all(eng, eid: int, toks: bytes, salt: str = "", rid: str = "w") -> list:  # type: ignore[no-untyped-def,type-arg]
    slots = eng.store(eid, rid, toks, salt)
    for s in slots:
        if s.status is SlotStatus.RESERVED:
            eng.arena.tensor(s.offset, s.size).fill_(s.chunk + 1)
    assert all(eng.commit(eid, [s.oid for s in slots if s.status is SlotStatus.RESERVED]))
    return slots


def test_store_commit_lookup_retrieve_release() -> None:
    with engine(1 << 20) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        toks = tokens(4 * CHUNK + 5)  # 4 full chunks; the tail is never a key
        slots = store_all(eng, eid, toks)
        assert [s.status for s in slots] == [SlotStatus.RESERVED] * 4
        hit = eng.lookup(eid, "r1", toks, "")
        assert (hit.hit_chunks, hit.hit_tokens, hit.total_chunks) == (4, 4 * CHUNK, 4)
        extents = eng.retrieve(eid, "r1", 1, 3)
        assert [int(eng.arena.tensor(e.offset, e.size)[0]) for e in extents] == [2, 3, 4]
        assert eng.release(eid, "r1") is True
        assert eng.cache.state_counts()["read_locked"] == 0


def test_second_store_says_exists_and_prefix_hits_stop_at_first_miss() -> None:
    with engine(1 << 20) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        store_all(eng, eid, tokens(2 * CHUNK))
        again = eng.store(eid, "w2", tokens(3 * CHUNK), "")
        assert [s.status for s in again] == [SlotStatus.EXISTS, SlotStatus.EXISTS, SlotStatus.RESERVED]
        eng.abort(eid, [again[2].oid])
        other = tokens(3 * CHUNK, start=1)  # differs from the first token: nothing in common
        assert eng.lookup(eid, "r", other, "").hit_chunks == 0
        assert eng.lookup(eid, "r", tokens(3 * CHUNK), "").hit_chunks == 2


def test_salt_and_engine_identity_isolate() -> None:
    with engine(1 << 20) as (eng, _):
        a = eng.register("m", small_layout()).engine_id
        b = eng.register("other-model", small_layout()).engine_id
        assert eng.register("m", small_layout()).engine_id == a  # idempotent
        store_all(eng, a, tokens(2 * CHUNK), salt="tenant-a")
        assert eng.lookup(a, "r", tokens(2 * CHUNK), "tenant-a").hit_chunks == 2
        assert eng.lookup(a, "r2", tokens(2 * CHUNK), "tenant-b").hit_chunks == 0
        assert eng.lookup(a, "r3", tokens(2 * CHUNK), "").hit_chunks == 0
        assert eng.lookup(b, "r4", tokens(2 * CHUNK), "tenant-a").hit_chunks == 0


def test_repeated_lookup_replaces_the_locks_of_that_request() -> None:
    with engine(1 << 20) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        store_all(eng, eid, tokens(3 * CHUNK))
        eng.lookup(eid, "r", tokens(3 * CHUNK), "")
        eng.lookup(eid, "r", tokens(3 * CHUNK), "")
        assert max(o.locks for o in eng.cache.objects()) == 1
        eng.lookup(eid, "r", tokens(1 * CHUNK), "")  # shorter: the other two are unlocked
        assert sorted(o.locks for o in eng.cache.objects()) == [0, 0, 1]
        assert eng.free_lookup_locks(eid, "r") == 1
        assert eng.cache.state_counts()["read_locked"] == 0


def test_committed_chunks_of_generated_tokens_are_counted_apart() -> None:
    with engine(1 << 20, write_lease_s=5) as (eng, clock):
        eid = eng.register("m", small_layout()).engine_id
        # A 20-token prompt then generated tokens: chunk 0 is prompt, chunk 1 ends after the
        # prompt (it holds generated tokens), chunks 2 and 3 are generated.
        slots = eng.store(eid, "r", tokens(4 * CHUNK), "", prompt_tokens=20)
        assert [s.status for s in slots] == [SlotStatus.RESERVED] * 4
        assert eng.commit(eid, [slots[0].oid, slots[1].oid]) == [True, True]
        eng.abort(eid, [slots[2].oid])
        clock.advance(5.1)
        eng.reap()
        assert eng.commit(eid, [slots[3].oid]) == [False]  # expired: not stored, not counted
        assert eng.counters.decode_chunks_stored == 1
        # Without prompt_tokens every chunk is prompt.
        store_all(eng, eid, tokens(2 * CHUNK, start=3))
        assert eng.counters.decode_chunks_stored == 1


def test_expired_write_lease_frees_memory_for_reuse() -> None:
    with engine(4 * 4096, write_lease_s=5) as (eng, clock):
        eid = eng.register("m", small_layout()).engine_id
        slots = eng.store(eid, "w", tokens(4 * CHUNK), "")
        assert all(s.status is SlotStatus.RESERVED for s in slots)
        assert eng.store(eid, "w2", tokens(1 * CHUNK, start=9), "")[0].status is SlotStatus.NO_SPACE
        clock.advance(5.1)
        assert eng.reap() == (4, 0)
        assert eng.commit(eid, [s.oid for s in slots]) == [False] * 4
        assert eng.store(eid, "w3", tokens(1 * CHUNK, start=9), "")[0].status is SlotStatus.RESERVED
        eng.cache.allocator.check()


def test_expired_read_lease_is_reported_to_a_late_reader() -> None:
    with engine(1 << 20, read_lease_s=3) as (eng, clock):
        eid = eng.register("m", small_layout()).engine_id
        store_all(eng, eid, tokens(2 * CHUNK))
        eng.lookup(eid, "r", tokens(2 * CHUNK), "")
        clock.advance(3.5)
        assert eng.reap() == (0, 1)
        with pytest.raises(NotFound, match="lease expired"):
            eng.retrieve(eid, "r", 0, 2)
        assert eng.release(eid, "r") is False
        assert eng.cache.state_counts()["read_locked"] == 0


def test_no_space_is_explicit_per_chunk_and_later_chunks_are_refused_too() -> None:
    with engine(3 * 4096) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        slots = eng.store(eid, "w", tokens(5 * CHUNK), "")
        assert [s.status for s in slots] == [SlotStatus.RESERVED] * 3 + [SlotStatus.NO_SPACE] * 2
        assert eng.counters.no_space_chunks == 2


def test_bad_input_is_refused() -> None:
    with engine(1 << 20) as (eng, _):
        with pytest.raises(InvalidInput, match="chunk size mismatch"):
            eng.register("m", small_layout(chunk_size=32))
        with pytest.raises(InvalidInput, match="larger than L1"):
            eng.register("m", small_layout(num_layers=1024, head_dim=1024))
        with pytest.raises(NotRegistered):
            eng.lookup(12345, "r", tokens(CHUNK), "")
        eid = eng.register("m", small_layout()).engine_id
        with pytest.raises(NotFound):
            eng.retrieve(eid, "nobody", 0, 1)
        with pytest.raises(InvalidInput):
            eng.lookup(eid, "r" * 300, tokens(CHUNK), "")
        with pytest.raises(InvalidInput):
            eng.store(eid, "w", tokens(CHUNK), "", first_chunk=5)


def test_clear_deletes_ready_and_dooms_locked() -> None:
    with engine(1 << 20) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        store_all(eng, eid, tokens(2 * CHUNK), salt="a")
        store_all(eng, eid, tokens(2 * CHUNK), salt="b")
        eng.lookup(eid, "r", tokens(2 * CHUNK), "a")
        assert eng.clear("a") == 2
        assert eng.lookup(eid, "r2", tokens(2 * CHUNK), "a").hit_chunks == 0
        assert eng.lookup(eid, "r3", tokens(2 * CHUNK), "b").hit_chunks == 2
        assert len(eng.retrieve(eid, "r", 0, 2)) == 2  # the earlier reader may still copy
        eng.release(eid, "r")
        eng.end_request(eid, "r3")
        assert eng.cache.allocator.used == 2 * 4096
