"""Object ids come from the OS's CSPRNG in batches: never 0, 62 bits, no repeats in practice."""

from __future__ import annotations

from engine.l1.oids import OidSource


def test_ids_are_nonzero_62_bit_and_distinct_across_batches() -> None:
    source = OidSource(batch=16)
    ids = [source.next() for _ in range(5000)]  # many refills
    assert all(0 < oid < 1 << 62 for oid in ids)
    assert len(set(ids)) == len(ids)
    assert max(ids).bit_length() > 55  # drawn over the whole range, not a counter


def test_two_sources_do_not_repeat_each_other() -> None:
    a, b = OidSource(), OidSource()
    assert not {a.next() for _ in range(1000)} & {b.next() for _ in range(1000)}
