"""The on-disk format of a slab file: its superblock and the header that starts every slot.

Stateless: pure functions and constants, safe from any thread. storage/slab/file.py reads and
writes them; storage/slab/adapter.py never sees raw bytes.

A slab file (or block device)::

    offset 0          superblock, one ALIGN block: magic b"KVDSLAB1" | version u16 | pad u16 |
                      pad u32 | slot_bytes u64 | slots u64 | file_bytes u64 | file id 16s |
                      xxh3_64 of everything before it
    ALIGN + i*slot    slot i: slot header (below) | the blob's header (storage/codec/blob_header.py) |
                      zeros up to `payload_offset` (a multiple of ALIGN) | the blob's payload

The slot header (little-endian, SLOT_HEADER_SIZE bytes)::

    magic b"KVDSLOT1" | version u16 | flags u16 | blob header length u32 | generation u64 |
    blob length u64 | key digest 16s (blake3 of the key) | payload checksum 16s (the blob
    header's xxh3_128) | file id 16s | slot number u64 | xxh3_64 of everything before it

A slot is valid only when its header's checksum, magic, version, file id and slot number are
right, the blob header behind it parses (its own checksum), names a key whose digest is the slot
header's, and its lengths and payload checksum agree with the slot header. The payload itself is
checked when it is read (codec.verify_in_place / decode_into): a torn write is a miss there.

Primitives in call order:
  pack_super(...) / parse_super(block) -> Superblock      (SlabFormatError when not ours / broken)
  key_digest(key)
  payload_offset(blob_head_len) / slot_need(blob_head_len, payload_len)
  pack_slot(...) -> bytes / parse_slot(area, file_id, slot) -> SlotHeader | None
  slot_blob(area, header) -> (key, blob header bytes) | None      the full check of a slot's head
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import blake3
import xxhash

from app.errors import IntegrityError
from storage.codec import blob_header
from storage.codec.blob_header import Buffer

ALIGN = 4096
SUPER_MAGIC = b"KVDSLAB1"
SLOT_MAGIC = b"KVDSLOT1"
VERSION = 1
DIGEST_BYTES = 16

_SUPER = struct.Struct("<8sHHIQQQ16s")
_SLOT = struct.Struct("<8sHHIQQ16s16s16sQ")
_CHECK = struct.Struct("<Q")
SUPER_SIZE = _SUPER.size + _CHECK.size
SLOT_HEADER_SIZE = _SLOT.size + _CHECK.size


class SlabFormatError(Exception):
    """A file or device that is not a usable slab (foreign, damaged, or of other dimensions)."""


@dataclass(frozen=True, slots=True)
class Superblock:
    slot_bytes: int
    slots: int
    file_bytes: int
    file_id: bytes


@dataclass(frozen=True, slots=True)
class SlotHeader:
    generation: int
    blob_len: int
    blob_head_len: int
    digest: bytes
    payload_checksum: bytes

    @property
    def payload_len(self) -> int:
        return self.blob_len - self.blob_head_len


def round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def slot_count(file_bytes: int, slot_bytes: int) -> int:
    return (file_bytes - ALIGN) // slot_bytes


def pack_super(slot_bytes: int, slots: int, file_bytes: int, file_id: bytes) -> bytes:
    body = _SUPER.pack(SUPER_MAGIC, VERSION, 0, 0, slot_bytes, slots, file_bytes, file_id)
    return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))


def parse_super(block: Buffer) -> Superblock:
    """The superblock at the start of `block`; SlabFormatError when it is not a valid one."""
    view = memoryview(block)
    if bytes(view[:8]) != SUPER_MAGIC:
        raise SlabFormatError("not a kvdepot slab (no slab superblock)")
    magic, version, _, _, slot_bytes, slots, file_bytes, file_id = _SUPER.unpack_from(view)
    (check,) = _CHECK.unpack_from(view, _SUPER.size)
    if xxhash.xxh3_64_intdigest(view[: _SUPER.size]) != check:
        raise SlabFormatError("slab superblock checksum mismatch")
    if version != VERSION:
        raise SlabFormatError(f"slab format version {version}; this build reads {VERSION}")
    del magic
    return Superblock(slot_bytes, slots, file_bytes, bytes(file_id))


def key_digest(key: str) -> bytes:
    return blake3.blake3(key.encode("utf-8")).digest(DIGEST_BYTES)


def payload_offset(blob_head_len: int) -> int:
    """Where the payload starts in a slot: after both headers, at the next ALIGN boundary."""
    return round_up(SLOT_HEADER_SIZE + blob_head_len)


def slot_need(blob_head_len: int, payload_len: int) -> int:
    """Bytes of slot a blob takes (its payload padded to ALIGN)."""
    return payload_offset(blob_head_len) + round_up(payload_len)


def pack_slot(
    *, generation: int, blob_len: int, blob_head_len: int, digest: bytes, payload_checksum: bytes,
    file_id: bytes, slot: int,
) -> bytes:  # fmt: skip
    body = _SLOT.pack(SLOT_MAGIC, VERSION, 0, blob_head_len, generation, blob_len, digest,
                      payload_checksum, file_id, slot)  # fmt: skip
    return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))


def parse_slot(area: Buffer, file_id: bytes, slot: int) -> SlotHeader | None:
    """The slot header at the start of `area` when it is valid for slot `slot` of the file
    `file_id`; None for anything else (empty, torn, foreign, moved)."""
    view = memoryview(area)
    if view.nbytes < SLOT_HEADER_SIZE or bytes(view[:8]) != SLOT_MAGIC:
        return None
    (check,) = _CHECK.unpack_from(view, _SLOT.size)
    if xxhash.xxh3_64_intdigest(view[: _SLOT.size]) != check:
        return None
    (_, version, _flags, head_len, generation, blob_len, digest, checksum, fid,
     number) = _SLOT.unpack_from(view)  # fmt: skip
    if version != VERSION or bytes(fid) != file_id or number != slot or blob_len < head_len:
        return None
    return SlotHeader(generation, blob_len, head_len, bytes(digest), bytes(checksum))


def slot_blob(area: Buffer, header: SlotHeader) -> tuple[str, bytes] | None:
    """The key and blob header bytes behind a valid slot header, when the blob header parses and
    agrees with it (digest of its key, lengths, payload checksum); None otherwise. `area` holds at
    least payload_offset(header.blob_head_len) bytes of the slot."""
    view = memoryview(area)
    head = bytes(view[SLOT_HEADER_SIZE : SLOT_HEADER_SIZE + header.blob_head_len])
    try:
        parsed = blob_header.read_header(head)
    except IntegrityError:
        return None
    if (
        parsed.header_len != header.blob_head_len
        or parsed.total_len != header.blob_len
        or parsed.payload_checksum != header.payload_checksum
        or key_digest(parsed.key) != header.digest
    ):
        return None
    return parsed.key, head
