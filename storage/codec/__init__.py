"""Codec: how one chunk of KV cache is laid out as an L2 blob, and how it is checked on the way back.

Stateless: pure functions, safe from any thread. They are CPU-bound on large payloads (checksum,
lz4, FP8 math), so callers run them in an executor for big chunks, never on the event loop.

A blob is a header followed by the encoded payload. The header (its layout, packing and parsing,
header_length / read_header / header_size / fits_in_place) is storage/codec/blob_header.py; this
module encodes payloads, signs blobs, and checks the whole blob on the way back.

Authentication (storage/auth.py): a signed blob has the `mac` flag, the id of the key that signed it
and a keyed BLAKE3 MAC over the fixed part up to the MAC (every field above, key id included), the
key and the encoded payload: no field nor payload byte can change without the key. A check with
keys (`keys` given) demands the flag, a known key id and the MAC, and then skips the xxh3 payload
checksum (the MAC covers it); a check without keys verifies the checksum (signed or not). Blobs of
VERSION 1 (before MACs) are refused as an unsupported version.

Payload encodings (flags):
  - none: the original bytes, byte-exact; `EncodedBlob.segments` then references the caller's buffer,
    so writers send it without a copy (the caller keeps the buffer unchanged until the write ends).
  - fp8_values (storage/codec/fp8.py): the original bytes are alternating K and V runs of `run_elems`
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
  decode_into(blob, expect_key, expect_fp, out, keys)
                                                checks everything (the MAC when `keys`), writes the
                                                original bytes into out

Zero-copy loads (an adapter reads a raw blob's payload straight into the L1 region, when
blob_header.fits_in_place says it may):
  verify_in_place(header, expect_key, expect_fp, out, keys)
                                                the checks of decode_into, over a header and a payload
                                                that already lies in out
  BlobCheck(expect_fp, keys, mac_threads)       either of the two, for an adapter to run in the thread
                                                that read the blob (no hop to another executor)

A large payload's MAC runs on BLAKE3's own threads: every core by default, `mac_threads` of them
where the caller runs several checks at once (mac_threads_beside(n): the cores shared out).

Every check failure raises app.errors.IntegrityError (AuthenticationError when the MAC is absent
or wrong; its subclass UnknownKey when the blob names a key id not among `keys`); such a blob must
be treated as a miss. An UnknownKey blob is another key list's (a fleet-mate mid-rotation): it is
never removed; other failures only from a tier private to this sidecar.

Bounded size: an encoding is kept only when it does not make the payload longer, so no blob of a
key is longer than blob_header.header_size(key) + its original length: readers never need to read more.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass

import blake3
import lz4.block
import xxhash

from app.errors import AuthenticationError, IntegrityError, UnknownKey
from kvdepot_connector.layout import dtype_size
from storage.auth import BlobKeys
from storage.codec.blob_header import (
    DTYPE_CODES,
    FLAG_FP8_VALUES,
    FLAG_LZ4,
    FLAG_MAC,
    LAYOUT_FP_SIZE,
    MAX_KEY_BYTES,
    BlobHeader,
    Buffer,
    ValueDtype,
    as_bytes_view,
    finish_header,
    key_field,
    mac_fields,
    pack_fixed,
    read_header,
    set_mac,
)

MAC_THREADS_MIN = 4 << 20  # payloads this large are MACed with several threads


@dataclass(frozen=True, slots=True)
class CodecOptions:
    """How payloads are encoded. `dtype` and `run_elems` describe the K/V run layout for FP8."""

    lz4: bool = False
    fp8_values: bool = False
    dtype: ValueDtype = "float16"
    run_elems: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"unsupported value dtype {self.dtype!r}; one of {sorted(DTYPE_CODES)}")
        if self.fp8_values and not 0 < self.run_elems <= 0xFFFFFFFF:
            raise ValueError("fp8_values needs run_elems > 0 (elements per K or V run)")

    @property
    def pair_bytes(self) -> int:
        """Bytes of one K run plus one V run in the original payload."""
        return 2 * self.run_elems * dtype_size(self.dtype)


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


def mac_threads_beside(concurrent: int) -> int:
    """Threads for one large payload's MAC when `concurrent` checks run at once (each on its own
    thread): the usable cores shared out among them, at least 1. A thread that reads and checks
    its own chunk beside others then leaves no core idle and oversubscribes none."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, concurrent))


def _mac(
    mac_key: bytes, signed_head: Buffer, key_bytes: Buffer, body: Buffer, threads: int | None = None
) -> bytes:
    """Keyed BLAKE3 over the header's fields (the fixed part up to the MAC), the key, the payload.
    A large payload (MAC_THREADS_MIN) is hashed with `threads` threads of BLAKE3's own pool (None:
    every core, so that one chunk's check takes a fraction of the time its load did); a small one
    on the calling thread."""
    many = blake3.blake3.AUTO if threads is None else threads
    hasher = blake3.blake3(key=mac_key, max_threads=many if memoryview(body).nbytes >= MAC_THREADS_MIN else 1)
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
    raw = as_bytes_view(payload)
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
        from storage.codec import fp8  # numpy and ml_dtypes are imported where FP8 is used

        quantized = fp8.encode(raw, options.dtype, options.run_elems)
        if quantized.nbytes <= raw.nbytes:  # tiny runs would grow: such a layout is stored raw
            body = quantized
            flags |= FLAG_FP8_VALUES
            dtype_code = DTYPE_CODES[options.dtype]
            run_elems = options.run_elems
    if options.lz4 and body.nbytes:
        packed = lz4.block.compress(body, store_size=False)
        if len(packed) < body.nbytes:
            body = memoryview(packed)
            flags |= FLAG_LZ4
    if signer is not None:
        flags |= FLAG_MAC
    fixed = pack_fixed(
        flags=flags,
        layout_fp=bytes(layout_fp),
        dtype_code=dtype_code,
        key_len=len(key_bytes),
        run_elems=run_elems,
        orig_len=raw.nbytes,
        enc_len=body.nbytes,
        payload_checksum=xxhash.xxh3_128_digest(body),
        key_id=None if signer is None else signer.signer.key_id,
    )
    if signer is not None:
        set_mac(fixed, _mac(signer.signer.key, mac_fields(memoryview(fixed)), key_bytes, body))
    return EncodedBlob(key=key, header=finish_header(fixed, key_bytes), payload=body)


def verify_in_place(
    header: Buffer, expect_key: str, expect_fp: bytes, out: Buffer, keys: BlobKeys | None = None, *,
    mac_threads: int | None = None,
) -> None:  # fmt: skip
    """Check a blob whose `header` (exactly the header bytes) was read apart and whose raw payload
    was read straight into `out`. The checks of decode_into: magic, version, header checksum, key,
    layout fingerprint, lengths, and the MAC (with `keys`) or else the payload checksum, computed
    over `out`; plus that the blob is raw (an FP8 or lz4 blob can never have been read in place).
    `mac_threads`: threads for a large payload's MAC (None: every core). Raises IntegrityError
    (AuthenticationError for a failed MAC check)."""
    head = as_bytes_view(header)
    parsed = _check_header(head, expect_key, expect_fp)
    if head.nbytes != parsed.header_len:
        raise IntegrityError(f"header is {head.nbytes} bytes, it says {parsed.header_len}")
    if parsed.encoded:
        raise IntegrityError(f"blob with flags {parsed.flags:#x} cannot be read in place")
    dest = as_bytes_view(out)
    if parsed.enc_len != parsed.orig_len:
        raise IntegrityError(f"raw blob says {parsed.enc_len} payload bytes for {parsed.orig_len}")
    if dest.nbytes != parsed.orig_len:
        raise IntegrityError(f"blob decodes to {parsed.orig_len} bytes, output holds {dest.nbytes}")
    _check_payload(parsed, head, dest, keys, mac_threads)


def _check_payload(
    header: BlobHeader, head: memoryview, body: memoryview, keys: BlobKeys | None, mac_threads: int | None
) -> None:
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
        raise UnknownKey(f"blob signed by a key this sidecar does not hold (id {header.key_id.hex()})")
    mac = _mac(mac_key, mac_fields(head), key_field(head, header.header_len), body, mac_threads)
    if not hmac.compare_digest(mac, header.mac):
        raise AuthenticationError("blob MAC mismatch")


@dataclass(frozen=True, slots=True)
class BlobCheck:
    """The check of every blob loaded for one layout, for an adapter to run in the thread that
    read it (storage/base.py load_into): `check(key, data, out, in_place)` is verify_in_place of a
    header whose payload lies in out (`in_place`), else decode_into of a whole blob into out; both
    with `keys` (None: the xxh3 checksum) and `mac_threads`. Raises as they do."""

    expect_fp: bytes
    keys: BlobKeys | None
    mac_threads: int | None = None

    def beside(self, concurrent: int) -> BlobCheck:
        """This check for a caller running `concurrent` of them at once, each on its own thread:
        a large MAC on its share of the cores (mac_threads_beside)."""
        return BlobCheck(self.expect_fp, self.keys, mac_threads_beside(concurrent))

    def __call__(self, key: str, data: Buffer, out: memoryview, in_place: bool) -> None:
        if in_place:
            verify_in_place(data, key, self.expect_fp, out, self.keys, mac_threads=self.mac_threads)
        else:
            decode_into(data, key, self.expect_fp, out, self.keys, mac_threads=self.mac_threads)


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
    blob: Buffer, expect_key: str, expect_fp: bytes, out: Buffer, keys: BlobKeys | None = None, *,
    mac_threads: int | None = None,
) -> None:  # fmt: skip
    """Check `blob` completely and write its original payload into `out` (exactly that size).

    Raises IntegrityError on any mismatch: magic, version, header checksum, key, layout
    fingerprint, lengths, the MAC (with `keys`: AuthenticationError) or else the payload checksum,
    size of `out`. Nothing is decoded before every check passed. ValueError if `out` is read-only.
    `mac_threads` as for verify_in_place.
    """
    view = as_bytes_view(blob)
    header = _check_header(view, expect_key, expect_fp)
    if view.nbytes != header.total_len:
        raise IntegrityError(f"blob is {view.nbytes} bytes, header says {header.total_len}")
    dest = as_bytes_view(out)
    if dest.readonly:
        raise ValueError("decode_into needs a writable output buffer")
    if dest.nbytes != header.orig_len:
        raise IntegrityError(f"blob decodes to {header.orig_len} bytes, output holds {dest.nbytes}")
    body = view[header.header_len :]
    _check_payload(header, view, body, keys, mac_threads)
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
        from storage.codec import fp8

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
