"""Blob header: the layout of the header that starts every L2 blob, how it is packed and parsed.

Stateless: pure functions and constants, safe from any thread. storage/codec/__init__.py packs a header when
it encodes a blob and checks it when it decodes one; the adapters read only headers from here (how
long one is, whether a blob can be read straight into its destination).

The header (little-endian) is::

    fixed part   magic b"KVD2" | version u16 | flags u16 | layout fingerprint 8s | dtype u8 | pad |
                 key length u16 | run_elems u32 | original length u64 | encoded length u64 |
                 xxh3_128 of the encoded payload 16s | key id 8s | MAC 32s              (96 bytes)
    key          the serialized key, utf-8                                    (key length bytes)
    checksum     xxh3_64 of the fixed part and the key                                    (8 bytes)

The MAC (computed by storage/codec/__init__.py) covers the fixed part up to the MAC, the key and the payload.
Blobs of VERSION 1 (before MACs) are refused as an unsupported version.

Primitives in call order:
  pack_fixed(...)                             the fixed part, MAC zeroed
  mac_fields(head), key_field(head, len)      what a MAC covers of a header (besides the payload)
  set_mac(fixed, mac)                         a signed blob's MAC into its fixed part
  finish_header(fixed, key_bytes)             the whole header: fixed part, key, checksum
  header_length(prefix)                       bytes of header, from its first HEADER_FIXED_SIZE bytes
  read_header(buf)                            -> BlobHeader; validates magic, version, header checksum
  header_size(key)                            header length of any blob of `key`
  fits_in_place(header, out_len)              whether a blob with this header is raw with a payload of
                                              exactly out_len bytes (False when unreadable)

Every check failure raises app.errors.IntegrityError; such a blob must be treated as a miss.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Literal

import xxhash

from app.errors import IntegrityError
from kvdepot_connector.layout import dtype_size
from storage.auth import KEY_ID_BYTES

MAGIC = b"KVD2"
VERSION = 2
FLAG_FP8_VALUES = 0x1
FLAG_LZ4 = 0x2
FLAG_MAC = 0x4
_KNOWN_FLAGS = FLAG_FP8_VALUES | FLAG_LZ4 | FLAG_MAC
_ENCODINGS = FLAG_FP8_VALUES | FLAG_LZ4
LAYOUT_FP_SIZE = 8
MAX_KEY_BYTES = 0xFFFF
MAC_SIZE = 32

_FIXED = struct.Struct(f"<4sHH8sBxHIQQ16s{KEY_ID_BYTES}s{MAC_SIZE}s")
_CHECKSUM = struct.Struct("<Q")
_KEY_LEN_AT = struct.calcsize("<4sHH8sBx")
_MAC_AT = _FIXED.size - MAC_SIZE
_NO_MAC = bytes(MAC_SIZE)
_NO_KEY_ID = bytes(KEY_ID_BYTES)
HEADER_FIXED_SIZE = _FIXED.size
MAX_HEADER_SIZE = _FIXED.size + MAX_KEY_BYTES + _CHECKSUM.size

ValueDtype = Literal["float16", "bfloat16", "float32"]
DTYPE_CODES: dict[str, int] = {"float16": 1, "bfloat16": 2, "float32": 3}
_DTYPE_NAMES: dict[int, ValueDtype] = {1: "float16", 2: "bfloat16", 3: "float32"}

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class BlobHeader:
    """A validated header. `header_len + enc_len` is the length of the whole blob."""

    version: int
    flags: int
    layout_fp: bytes
    key: str
    dtype: ValueDtype | None
    run_elems: int
    orig_len: int
    enc_len: int
    payload_checksum: bytes
    key_id: bytes
    mac: bytes
    header_len: int

    @property
    def fp8_values(self) -> bool:
        return bool(self.flags & FLAG_FP8_VALUES)

    @property
    def lz4(self) -> bool:
        return bool(self.flags & FLAG_LZ4)

    @property
    def signed(self) -> bool:
        return bool(self.flags & FLAG_MAC)

    @property
    def encoded(self) -> bool:
        """FP8 or lz4: the payload is not the original bytes."""
        return bool(self.flags & _ENCODINGS)

    @property
    def total_len(self) -> int:
        return self.header_len + self.enc_len


def as_bytes_view(buf: Buffer) -> memoryview:
    """`buf` as a flat view of bytes (no copy)."""
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def pack_fixed(
    *,
    flags: int,
    layout_fp: bytes,
    dtype_code: int,
    key_len: int,
    run_elems: int,
    orig_len: int,
    enc_len: int,
    payload_checksum: bytes,
    key_id: bytes | None,
) -> bytearray:
    """The fixed part of a header, its MAC zeroed (the signer fills it in with set_mac)."""
    return bytearray(
        _FIXED.pack(
            MAGIC,
            VERSION,
            flags,
            bytes(layout_fp),
            dtype_code,
            key_len,
            run_elems,
            orig_len,
            enc_len,
            payload_checksum,
            _NO_KEY_ID if key_id is None else key_id,
            _NO_MAC,
        )
    )


def mac_fields(head: memoryview) -> memoryview:
    """The fields of a header a MAC covers: its fixed part up to the MAC (key id included)."""
    return head[:_MAC_AT]


def key_field(head: memoryview, header_len: int) -> memoryview:
    """The serialized key in a header of `header_len` bytes (as the MAC covers it)."""
    return head[_FIXED.size : header_len - _CHECKSUM.size]


def set_mac(fixed: bytearray, mac: bytes) -> None:
    """Write `mac` into the fixed part packed by pack_fixed."""
    fixed[_MAC_AT:] = mac


def finish_header(fixed: bytearray, key_bytes: bytes) -> bytes:
    """The whole header: the fixed part, the key, the checksum of both."""
    head = bytes(fixed) + key_bytes
    return head + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(head))


def header_length(prefix: Buffer) -> int:
    """Total header length, from at least the first HEADER_FIXED_SIZE bytes of a blob."""
    view = as_bytes_view(prefix)
    if view.nbytes < _FIXED.size:
        raise IntegrityError(f"blob truncated: {view.nbytes} bytes, header needs {_FIXED.size}")
    if bytes(view[:4]) != MAGIC:
        raise IntegrityError("bad magic: not a kvdepot blob")
    version = int.from_bytes(view[4:6], "little")
    if version != VERSION:  # the layout of the rest depends on it: said before anything else
        raise IntegrityError(f"unsupported blob version {version}; this build reads {VERSION}")
    key_len = int.from_bytes(view[_KEY_LEN_AT : _KEY_LEN_AT + 2], "little")
    return _FIXED.size + key_len + _CHECKSUM.size


def read_header(buf: Buffer) -> BlobHeader:
    """Parse and validate the header at the start of `buf` (which may hold more than the header)."""
    view = as_bytes_view(buf)
    header_len = header_length(view)
    if view.nbytes < header_len:
        raise IntegrityError(f"blob truncated: {view.nbytes} bytes, header needs {header_len}")
    (_magic, version, flags, layout_fp, dtype_code, key_len, run_elems, orig_len, enc_len, digest, key_id,
     mac) = _FIXED.unpack_from(view)  # fmt: skip
    body_end = _FIXED.size + key_len
    (stored_checksum,) = _CHECKSUM.unpack_from(view, body_end)
    if xxhash.xxh3_64_intdigest(view[:body_end]) != stored_checksum:
        raise IntegrityError("header checksum mismatch")
    if version != VERSION:
        raise IntegrityError(f"unsupported blob version {version}; this build reads {VERSION}")
    if flags & ~_KNOWN_FLAGS:
        raise IntegrityError(f"unknown blob flags {flags:#x}")
    try:
        key = bytes(view[_FIXED.size : body_end]).decode("utf-8")
    except UnicodeDecodeError:
        raise IntegrityError("blob key is not utf-8") from None
    dtype: ValueDtype | None = None
    if flags & FLAG_FP8_VALUES:
        dtype = _DTYPE_NAMES.get(dtype_code)
        if dtype is None or run_elems == 0:
            raise IntegrityError("fp8 blob without a valid value dtype and run length")
        if orig_len % (2 * run_elems * dtype_size(dtype)):
            raise IntegrityError("fp8 blob length is not a whole number of K/V run pairs")
    return BlobHeader(
        version=version,
        flags=flags,
        layout_fp=bytes(layout_fp),
        key=key,
        dtype=dtype,
        run_elems=run_elems,
        orig_len=orig_len,
        enc_len=enc_len,
        payload_checksum=bytes(digest),
        key_id=bytes(key_id),
        mac=bytes(mac),
        header_len=header_len,
    )


def header_size(key: str) -> int:
    """Length of the header of every blob stored under `key` (the key is part of the header)."""
    return _FIXED.size + len(key.encode("utf-8")) + _CHECKSUM.size


def fits_in_place(header: Buffer, out_len: int) -> bool:
    """True when `header` starts a raw blob (no FP8, no lz4; signed or not) whose payload is exactly `out_len`
    bytes: its payload may then be read straight into the output. False for anything else,
    unreadable headers included (such a blob is read whole and decode_into says what is wrong).
    Checks nothing else: codec.verify_in_place does once the payload is there."""
    view = as_bytes_view(header)
    if view.nbytes < _FIXED.size or bytes(view[:4]) != MAGIC:
        return False
    fields = _FIXED.unpack_from(view)
    version, flags, orig_len, enc_len = fields[1], fields[2], fields[7], fields[8]
    return bool(version == VERSION and not flags & ~FLAG_MAC and orig_len == enc_len == out_len)
