"""The codec's side of zero-copy loads: header_size, fits_in_place, verify_in_place."""

from __future__ import annotations

import os
import struct

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from app.errors import IntegrityError
from storage import codec
from storage.codec import CodecOptions, blob_header

KEY = "kvd1/m=model/l=0011223344556677/r=0/g=0/s=/h=" + "ab" * 32
FP = bytes.fromhex("0011223344556677")
FLAGS_AT = 6
ORIG_LEN_AT = struct.calcsize("<4sHH8sBxHI")


def split(blob: codec.EncodedBlob) -> tuple[bytes, bytearray]:
    """What an adapter reading in place ends up with: the header apart, the payload in `out`."""
    raw = blob.to_bytes()
    head_len = blob_header.header_size(blob.key)
    return raw[:head_len], bytearray(raw[head_len:])


def resealed(header: bytes, offset: int, fmt: str, value: int) -> bytes:
    """The header with one field changed and its checksum recomputed."""
    damaged = bytearray(header)
    struct.pack_into(fmt, damaged, offset, value)
    struct.pack_into("<Q", damaged, len(damaged) - 8, xxhash.xxh3_64_intdigest(bytes(damaged[:-8])))
    return bytes(damaged)


@settings(max_examples=40, deadline=None)
@given(payload=st.binary(max_size=4096), key=st.text(min_size=1, max_size=80))
def test_a_raw_blob_split_at_header_size_verifies_in_place(payload: bytes, key: str) -> None:
    blob = codec.encode(key, FP, payload, CodecOptions())
    assert blob_header.header_size(key) == len(blob.header)
    header, out = split(blob)
    assert blob_header.fits_in_place(header, len(payload))
    codec.verify_in_place(header, key, FP, out)
    assert out == payload


def test_every_byte_flip_in_header_or_payload_is_caught() -> None:
    blob = codec.encode(KEY, FP, os.urandom(700), CodecOptions())
    header, out = split(blob)
    for position in range(len(header)):
        damaged = bytearray(header)
        damaged[position] ^= 0x01
        with pytest.raises(IntegrityError):
            codec.verify_in_place(damaged, KEY, FP, out)
    for position in range(len(out)):
        out[position] ^= 0x01
        with pytest.raises(IntegrityError, match="payload checksum"):
            codec.verify_in_place(header, KEY, FP, out)
        out[position] ^= 0x01
    codec.verify_in_place(header, KEY, FP, out)


def test_wrong_key_fingerprint_size_or_header_length_is_caught() -> None:
    blob = codec.encode(KEY, FP, os.urandom(512), CodecOptions())
    header, out = split(blob)
    with pytest.raises(IntegrityError, match="key"):
        codec.verify_in_place(header, KEY + "x", FP, out)
    with pytest.raises(IntegrityError, match="fingerprint"):
        codec.verify_in_place(header, KEY, bytes(8), out)
    with pytest.raises(IntegrityError, match="output"):
        codec.verify_in_place(header, KEY, FP, out + b"\0")
    with pytest.raises(IntegrityError):
        codec.verify_in_place(header + b"\0", KEY, FP, out)
    with pytest.raises(IntegrityError):
        codec.verify_in_place(header[:-1], KEY, FP, out)
    with pytest.raises(IntegrityError, match="magic"):
        codec.verify_in_place(b"KVD1" + header[4:], KEY, FP, out)


def test_lengths_that_lie_consistently_sealed_are_caught() -> None:
    blob = codec.encode(KEY, FP, os.urandom(512), CodecOptions())
    header, out = split(blob)
    with pytest.raises(IntegrityError):
        codec.verify_in_place(resealed(header, ORIG_LEN_AT, "<Q", 513), KEY, FP, out + b"\0")
    with pytest.raises(IntegrityError, match="raw blob says"):
        codec.verify_in_place(resealed(header, ORIG_LEN_AT + 8, "<Q", 511), KEY, FP, out)


def test_blobs_that_are_not_raw_never_fit_nor_verify_in_place() -> None:
    payload = bytes(64 * 1024)  # compresses
    lz4 = codec.encode(KEY, FP, payload, CodecOptions(lz4=True))
    assert blob_header.read_header(lz4.header).lz4
    assert not blob_header.fits_in_place(lz4.header, len(payload))
    # FP8 with float16 runs of 4 elements encodes to exactly the original length: only the flags
    # tell it apart from a raw blob
    kv = torch.randn(1024, 2, 4).to(torch.float16)
    raw = bytes(kv.view(torch.uint8).numpy())
    fp8 = codec.encode(KEY, FP, raw, CodecOptions(fp8_values=True, dtype="float16", run_elems=4))
    assert fp8.payload.nbytes == len(raw)
    assert not blob_header.fits_in_place(fp8.header, len(raw))
    with pytest.raises(IntegrityError, match="in place"):
        codec.verify_in_place(fp8.header, KEY, FP, bytearray(fp8.payload))
    # a raw header whose flags were changed and resealed
    header, out = split(codec.encode(KEY, FP, os.urandom(256), CodecOptions()))
    with pytest.raises(IntegrityError, match="in place"):
        codec.verify_in_place(resealed(header, FLAGS_AT, "<H", blob_header.FLAG_LZ4), KEY, FP, out)


def test_fits_in_place_needs_the_exact_payload_size_and_a_readable_header() -> None:
    blob = codec.encode(KEY, FP, os.urandom(300), CodecOptions())
    assert blob_header.fits_in_place(blob.header, 300)
    assert not blob_header.fits_in_place(blob.header, 299)
    assert not blob_header.fits_in_place(blob.header[:10], 300)
    assert not blob_header.fits_in_place(b"XXXX" + blob.header[4:], 300)
