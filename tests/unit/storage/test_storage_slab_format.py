"""The slab format's headers and the start-up merge of the slots with a checkpoint: pure
functions, no files."""

from __future__ import annotations

import pytest

from storage import codec
from storage.codec import CodecOptions, blob_header
from storage.slab import headers as slab_headers
from storage.slab.headers import SlabFormatError
from storage.slab.index import Checkpoint, SlotEntry, merge

FILE = bytes(range(16))


def test_superblock_round_trip_and_refusals() -> None:
    block = bytearray(slab_headers.pack_super(69632, 10, 4096 + 10 * 69632, FILE).ljust(4096, b"\0"))
    sb = slab_headers.parse_super(block)
    assert (sb.slot_bytes, sb.slots, sb.file_bytes, sb.file_id) == (69632, 10, 4096 + 10 * 69632, FILE)
    with pytest.raises(SlabFormatError, match="not a kvdepot slab"):
        slab_headers.parse_super(b"PK\x03\x04" + bytes(4092))
    block[20] ^= 1
    with pytest.raises(SlabFormatError, match="checksum"):
        slab_headers.parse_super(block)


def slot_area(key: str, generation: int, slot: int, file_id: bytes = FILE) -> tuple[bytes, int]:
    blob = codec.encode(key, b"layoutfp", b"x" * 5000, CodecOptions())
    checksum = bytes(16) if key == "bad" else blob_header.read_header(blob.header).payload_checksum
    head = slab_headers.pack_slot(
        generation=generation, blob_len=blob.nbytes, blob_head_len=len(blob.header),
        digest=slab_headers.key_digest(key), payload_checksum=checksum, file_id=file_id, slot=slot,
    )  # fmt: skip
    return (head + blob.header).ljust(4096, b"\0"), blob.nbytes


def test_a_slot_head_is_valid_only_for_its_file_slot_and_blob() -> None:
    area, blob_len = slot_area("key-1", 7, 3)
    header = slab_headers.parse_slot(area, FILE, 3)
    assert header is not None and (header.generation, header.blob_len) == (7, blob_len)
    found = slab_headers.slot_blob(area, header)
    assert found is not None and found[0] == "key-1"
    assert slab_headers.parse_slot(area, FILE, 4) is None  # moved
    assert slab_headers.parse_slot(area, bytes(16), 3) is None  # another file's
    assert slab_headers.parse_slot(bytes(4096), FILE, 3) is None  # empty
    torn = bytearray(area)
    torn[40] ^= 0x10
    assert slab_headers.parse_slot(torn, FILE, 3) is None
    bad, _ = slot_area("bad", 1, 0)  # the blob header's checksum is not the slot header's
    bad_header = slab_headers.parse_slot(bad, FILE, 0)
    assert bad_header is not None and slab_headers.slot_blob(bad, bad_header) is None


def test_payload_offsets_are_aligned() -> None:
    assert slab_headers.payload_offset(200) == 4096
    assert slab_headers.payload_offset(4096 - slab_headers.SLOT_HEADER_SIZE + 1) == 8192
    assert slab_headers.slot_need(200, 65536) == 4096 + 65536
    assert slab_headers.slot_need(200, 1) == 8192


def entry(key: str, slot: int, gen: int, file_id: str = "f0", size: int = 100) -> SlotEntry:
    return SlotEntry(key, file_id, slot, gen, size, 50)


def test_merge_keeps_the_newest_generation_in_checkpoint_order() -> None:
    found = [entry("a", 0, 5), entry("b", 1, 2), entry("a", 2, 9), entry("c", 3, 1), entry("d", 4, 12)]
    hint = Checkpoint(4096, 11, [entry("c", 3, 1), entry("a", 2, 9), entry("b", 1, 1), entry("x", 5, 3)])
    merged = merge(found, hint)
    assert [e.key for e in merged.entries] == ["c", "a", "b", "d"]  # confirmed hints first, then by gen
    assert merged.superseded == [entry("a", 0, 5)]
    assert merged.stale == 2  # b's generation differs, x is gone
    assert merged.next_generation == 13


def test_merge_without_a_checkpoint_orders_by_generation() -> None:
    merged = merge([entry("a", 0, 3), entry("b", 1, 1), entry("a", 2, 2)], None)
    assert [e.key for e in merged.entries] == ["b", "a"]
    assert merged.superseded == [entry("a", 2, 2)]
    assert (merged.stale, merged.next_generation) == (0, 4)
