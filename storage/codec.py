"""Codec: how one chunk of KV cache is laid out as an L2 blob, and how it is checked on the way back.

Stateless: pure functions, safe from any thread. They are CPU-bound on large payloads (checksum,
lz4, FP8 math), so callers run them in an executor for big chunks, never on the event loop.

A blob is a header followed by the encoded payload. The header (little-endian) is::

    fixed part   magic b"KVD2" | version u16 | flags u16 | layout fingerprint 8s | dtype u8 | pad |
                 key length u16 | run_elems u32 | original length u64 | encoded length u64 |
                 xxh3_128 of the encoded payload 16s | key id 8s | MAC 32s              (96 bytes)
    key          the serialized key, utf-8                                    (key length bytes)
    checksum     xxh3_64 of the fixed part and the key                                    (8 bytes)

Authentication (storage/auth.py): a signed blob has the `mac` flag, the id of the key that signed it
and a keyed BLAKE3 MAC over the fixed part up to the MAC (every field above, key id included), the
key and the encoded payload: no field nor payload byte can change without the key. A check with
keys (`keys` given) demands the flag, a known key id and the MAC, and then skips the xxh3 payload
checksum (the MAC covers it); a check without keys verifies the checksum (signed or not). Blobs of
VERSION 1 (before MACs) are refused as an unsupported version.

Payload encodings (flags):
  - none: the original bytes, byte-exact; `EncodedBlob.segments` then references the caller's buffer,
    so writers send it without a copy (the caller keeps the buffer unchanged until the write ends).
  - fp8_values (storage/fp8.py): the original bytes are alternating K and V runs of `run_elems`
    elements of `dtype`. K runs are kept exactly; each V run becomes float8_e4m3fn with one
    float32 scale per run (scale = absmax / 448, 1.0 for an all-zero run). Encoded as
    [scales | K runs | V fp8 runs].
    LOSSY by design: a decoded V element differs from the original by at most ~1/16 of its
    magnitude plus scale * 2**-10 (e4m3 rounding), plus the rounding to `dtype`; non-finite V values
    are not preserved. Everything else is byte-exact.
  - lz4: the (possibly FP8-encoded) payload compressed with lz4 block format; kept only when it
    actually shrinks the payload, otherwise the flag is dropped and the bytes are stored as they are.

Primitives in call order:
  encode(key, layout_fp, payload, options, signer)
                                                -> EncodedBlob (segments = [header, payload]);
                                                signed when `signer` (a BlobKeys) is given
  header_length(prefix)                         bytes of header, from its first HEADER_FIXED_SIZE bytes
  read_header(buf)                              -> BlobHeader; validates magic, version, header checksum
  decode_into(blob, expect_key, expect_fp, out, keys)
                                                checks everything (the MAC when `keys`), writes the
                                                original bytes into out

Zero-copy loads (an adapter reads a raw blob's payload straight into the L1 region):
  header_size(key)                              header length of any blob of `key`
  fits_in_place(header, out_len)                whether a blob with this header is raw with a payload
                                                of exactly out_len bytes (False when unreadable)
  verify_in_place(header, expect_key, expect_fp, out, keys)
                                                the checks of decode_into, over a header and a payload
                                                that already lies in out

Every check failure raises app.errors.IntegrityError (AuthenticationError when the MAC is absent,
of an unknown key or wrong); such a blob must be treated as a miss.

Bounded size: an encoding is kept only when it does not make the payload longer, so no blob of a
key is longer than header_size(key) + its original length: readers never need to read more.
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass
from typing import Literal

import blake3
import lz4.block
import xxhash

from app.errors import AuthenticationError, IntegrityError
from kvdepot_connector.layout import dtype_size
from storage import fp8
from storage.auth import KEY_ID_BYTES, BlobKeys

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
MAC_THREADS_MIN = 4 << 20  # payloads this large are MACed with several threads

_FIXED = struct.Struct(f"<4sHH8sBxHIQQ16s{KEY_ID_BYTES}s{MAC_SIZE}s")
_CHECKSUM = struct.Struct("<Q")
_KEY_LEN_AT = struct.calcsize("<4sHH8sBx")
_MAC_AT = _FIXED.size - MAC_SIZE
_NO_MAC = bytes(MAC_SIZE)
_NO_KEY_ID = bytes(KEY_ID_BYTES)
HEADER_FIXED_SIZE = _FIXED.size
MAX_HEADER_SIZE = _FIXED.size + MAX_KEY_BYTES + _CHECKSUM.size

ValueDtype = Literal["float16", "bfloat16", "float32"]
_DTYPE_CODES: dict[str, int] = {"float16": 1, "bfloat16": 2, "float32": 3}
_DTYPE_NAMES: dict[int, ValueDtype] = {1: "float16", 2: "bfloat16", 3: "float32"}

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class CodecOptions:
    """How payloads are encoded. `dtype` and `run_elems` describe the K/V run layout for FP8."""

    lz4: bool = False
    fp8_values: bool = False
    dtype: ValueDtype = "float16"
    run_elems: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_CODES:
            raise ValueError(f"unsupported value dtype {self.dtype!r}; one of {sorted(_DTYPE_CODES)}")
        if self.fp8_values and not 0 < self.run_elems <= 0xFFFFFFFF:
            raise ValueError("fp8_values needs run_elems > 0 (elements per K or V run)")

    @property
    def pair_bytes(self) -> int:
        """Bytes of one K run plus one V run in the original payload."""
        return 2 * self.run_elems * dtype_size(self.dtype)


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


@dataclass(frozen=True, slots=True)
class EncodedBlob:
    """A blob ready to write: `segments` are written back to back; nothing else is needed."""

    key: str
    header: bytes
    payload: memoryview

    @property
    def segments(self) -> tuple[bytes, memoryview]:
        return (self.header, self.payload)

    @property
    def nbytes(self) -> int:
        return len(self.header) + self.payload.nbytes

    def to_bytes(self) -> bytes:
        """The blob as one buffer (one copy of the payload)."""
        return b"".join(self.segments)


def _as_bytes_view(buf: Buffer) -> memoryview:
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _mac(mac_key: bytes, signed_head: Buffer, key_bytes: Buffer, body: Buffer) -> bytes:
    """Keyed BLAKE3 over the header's fields (the fixed part up to the MAC), the key, the payload.
    A large payload is hashed on every core (BLAKE3's own thread pool): one chunk's check then
    takes a fraction of the time its load did."""
    threads = blake3.blake3.AUTO if memoryview(body).nbytes >= MAC_THREADS_MIN else 1
    hasher = blake3.blake3(key=mac_key, max_threads=threads)
    hasher.update(signed_head)
    hasher.update(key_bytes)
    hasher.update(body)
    return hasher.digest()


def encode(
    key: str, layout_fp: bytes, payload: Buffer, options: CodecOptions, signer: BlobKeys | None = None
) -> EncodedBlob:
    """Encode `payload` (C-contiguous) under `key`, signed with `signer`'s first key when given.
    Raises ValueError for unusable arguments."""
    key_bytes = key.encode("utf-8")
    if len(key_bytes) > MAX_KEY_BYTES:
        raise ValueError(f"serialized key is {len(key_bytes)} bytes; at most {MAX_KEY_BYTES}")
    if len(layout_fp) != LAYOUT_FP_SIZE:
        raise ValueError(f"layout fingerprint must be {LAYOUT_FP_SIZE} bytes, got {len(layout_fp)}")
    raw = _as_bytes_view(payload)
    flags = 0
    dtype_code = 0
    run_elems = 0
    body: memoryview = raw
    if options.fp8_values:
        if raw.nbytes % options.pair_bytes:
            raise ValueError(
                f"payload of {raw.nbytes} bytes is not a whole number of K/V run pairs "
                f"({options.pair_bytes} bytes each)"
            )
        quantized = fp8.encode(raw, options.dtype, options.run_elems)
        if quantized.nbytes <= raw.nbytes:  # tiny runs would grow: such a layout is stored raw
            body = quantized
            flags |= FLAG_FP8_VALUES
            dtype_code = _DTYPE_CODES[options.dtype]
            run_elems = options.run_elems
    if options.lz4 and body.nbytes:
        packed = lz4.block.compress(body, store_size=False)
        if len(packed) < body.nbytes:
            body = memoryview(packed)
            flags |= FLAG_LZ4
    if signer is not None:
        flags |= FLAG_MAC
    fixed = bytearray(
        _FIXED.pack(
            MAGIC,
            VERSION,
            flags,
            bytes(layout_fp),
            dtype_code,
            len(key_bytes),
            run_elems,
            raw.nbytes,
            body.nbytes,
            xxhash.xxh3_128_digest(body),
            _NO_KEY_ID if signer is None else signer.signer.key_id,
            _NO_MAC,
        )
    )
    if signer is not None:
        fixed[_MAC_AT:] = _mac(signer.signer.key, memoryview(fixed)[:_MAC_AT], key_bytes, body)
    head = bytes(fixed) + key_bytes
    return EncodedBlob(key=key, header=head + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(head)), payload=body)


def header_length(prefix: Buffer) -> int:
    """Total header length, from at least the first HEADER_FIXED_SIZE bytes of a blob."""
    view = _as_bytes_view(prefix)
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
    view = _as_bytes_view(buf)
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
    Checks nothing else: verify_in_place does once the payload is there."""
    view = _as_bytes_view(header)
    if view.nbytes < _FIXED.size or bytes(view[:4]) != MAGIC:
        return False
    fields = _FIXED.unpack_from(view)
    version, flags, orig_len, enc_len = fields[1], fields[2], fields[7], fields[8]
    return bool(version == VERSION and not flags & ~FLAG_MAC and orig_len == enc_len == out_len)


def verify_in_place(
    header: Buffer, expect_key: str, expect_fp: bytes, out: Buffer, keys: BlobKeys | None = None
) -> None:
    """Check a blob whose `header` (exactly the header bytes) was read apart and whose raw payload
    was read straight into `out`. The checks of decode_into: magic, version, header checksum, key,
    layout fingerprint, lengths, and the MAC (with `keys`) or else the payload checksum, computed
    over `out`; plus that the blob is raw (an FP8 or lz4 blob can never have been read in place).
    Raises IntegrityError (AuthenticationError for a failed MAC check)."""
    head = _as_bytes_view(header)
    parsed = _check_header(head, expect_key, expect_fp)
    if head.nbytes != parsed.header_len:
        raise IntegrityError(f"header is {head.nbytes} bytes, it says {parsed.header_len}")
    if parsed.encoded:
        raise IntegrityError(f"blob with flags {parsed.flags:#x} cannot be read in place")
    dest = _as_bytes_view(out)
    if parsed.enc_len != parsed.orig_len:
        raise IntegrityError(f"raw blob says {parsed.enc_len} payload bytes for {parsed.orig_len}")
    if dest.nbytes != parsed.orig_len:
        raise IntegrityError(f"blob decodes to {parsed.orig_len} bytes, output holds {dest.nbytes}")
    _check_payload(parsed, head, dest, keys)


def _check_payload(header: BlobHeader, head: memoryview, body: memoryview, keys: BlobKeys | None) -> None:
    """With `keys`: the blob must be signed by one of them, its MAC right (the xxh3 checksum is
    then redundant). Without: the xxh3 checksum of the payload."""
    if keys is None:
        if xxhash.xxh3_128_digest(body) != header.payload_checksum:
            raise IntegrityError("payload checksum mismatch")
        return
    if not header.signed:
        raise AuthenticationError("blob is not signed")
    mac_key = keys.mac_key(header.key_id)
    if mac_key is None:
        raise AuthenticationError(f"blob signed by an unknown key (id {header.key_id.hex()})")
    key_at = _FIXED.size
    mac = _mac(mac_key, head[:_MAC_AT], head[key_at : header.header_len - _CHECKSUM.size], body)
    if not hmac.compare_digest(mac, header.mac):
        raise AuthenticationError("blob MAC mismatch")


def _check_header(view: memoryview, expect_key: str, expect_fp: bytes) -> BlobHeader:
    header = read_header(view)
    if header.key != expect_key:
        raise IntegrityError(f"blob holds key {header.key!r}, expected {expect_key!r}")
    if header.layout_fp != bytes(expect_fp):
        raise IntegrityError(
            f"layout fingerprint {header.layout_fp.hex()} differs from expected {bytes(expect_fp).hex()}"
        )
    return header


def decode_into(
    blob: Buffer, expect_key: str, expect_fp: bytes, out: Buffer, keys: BlobKeys | None = None
) -> None:
    """Check `blob` completely and write its original payload into `out` (exactly that size).

    Raises IntegrityError on any mismatch: magic, version, header checksum, key, layout
    fingerprint, lengths, the MAC (with `keys`: AuthenticationError) or else the payload checksum,
    size of `out`. Nothing is decoded before every check passed. ValueError if `out` is read-only.
    """
    view = _as_bytes_view(blob)
    header = _check_header(view, expect_key, expect_fp)
    if view.nbytes != header.total_len:
        raise IntegrityError(f"blob is {view.nbytes} bytes, header says {header.total_len}")
    dest = _as_bytes_view(out)
    if dest.readonly:
        raise ValueError("decode_into needs a writable output buffer")
    if dest.nbytes != header.orig_len:
        raise IntegrityError(f"blob decodes to {header.orig_len} bytes, output holds {dest.nbytes}")
    body = view[header.header_len :]
    _check_payload(header, view, body, keys)
    if header.lz4:
        expected = _fp8_encoded_len(header) if header.fp8_values else header.orig_len
        try:
            body = memoryview(lz4.block.decompress(body, uncompressed_size=expected))
        except lz4.block.LZ4BlockError as exc:
            raise IntegrityError(f"lz4 payload does not decompress: {exc}") from None
        if body.nbytes != expected:
            raise IntegrityError(f"lz4 payload decompressed to {body.nbytes} bytes, expected {expected}")
    if header.fp8_values:
        assert header.dtype is not None  # read_header guarantees it
        if body.nbytes != _fp8_encoded_len(header):
            raise IntegrityError("fp8 payload length does not match its run layout")
        fp8.decode(body, header.dtype, header.run_elems, dest)
    else:
        if body.nbytes != dest.nbytes:
            raise IntegrityError(f"payload is {body.nbytes} bytes, header says {dest.nbytes}")
        dest[:] = body


def _fp8_encoded_len(header: BlobHeader) -> int:
    assert header.dtype is not None
    esize = dtype_size(header.dtype)
    pairs = header.orig_len // (2 * header.run_elems * esize)
    return pairs * (4 + header.run_elems * esize + header.run_elems)
