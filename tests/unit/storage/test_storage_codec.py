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
from storage.codec import CodecOptions, blob_header, fp8

KEY = "kvd1/m=model/l=0011223344556677/r=0/g=0/s=/h=" + "ab" * 32
FP = bytes.fromhex("0011223344556677")
ORIG_LEN_AT = struct.calcsize("<4sHH8sBxHI")  # offset of the original length in the header


def _decode(blob: blob_header.Buffer, size: int, key: str = KEY, fp: bytes = FP) -> bytes:
    out = bytearray(size)
    codec.decode_into(blob, key, fp, out)
    return bytes(out)


def _kv_tensor(pairs: int, run_elems: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-3, 2, pairs, dtype=torch.float32)[:, None, None]  # wide dynamic range
    return (torch.randn(pairs, 2, run_elems, generator=gen) * scale).to(dtype)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy())


def _from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)


# --- round trips --------------------------------------------------------------------------------


def test_raw_round_trip_is_byte_exact_and_does_not_copy_the_payload() -> None:
    payload = bytearray(os.urandom(10_000))
    blob = codec.encode(KEY, FP, memoryview(payload), CodecOptions())
    header, body = blob.segments
    assert body.obj is payload  # written as it is, no copy
    assert blob.nbytes == len(header) + len(payload)
    assert _decode(blob.to_bytes(), len(payload)) == payload
    parsed = blob_header.read_header(header)
    assert (parsed.key, parsed.layout_fp, parsed.orig_len, parsed.enc_len) == (KEY, FP, 10_000, 10_000)
    assert not parsed.lz4
    assert not parsed.fp8_values


def test_empty_payload_round_trips() -> None:
    blob = codec.encode(KEY, FP, b"", CodecOptions(lz4=True))
    assert _decode(blob.to_bytes(), 0) == b""


def test_lz4_shrinks_compressible_payloads_and_round_trips() -> None:
    payload = bytes(range(256)) * 400
    blob = codec.encode(KEY, FP, payload, CodecOptions(lz4=True))
    assert blob_header.read_header(blob.header).lz4
    assert blob.nbytes < len(payload) // 4
    assert _decode(blob.to_bytes(), len(payload)) == payload


def test_lz4_is_dropped_when_it_does_not_help() -> None:
    payload = os.urandom(50_000)
    blob = codec.encode(KEY, FP, payload, CodecOptions(lz4=True))
    assert not blob_header.read_header(blob.header).lz4
    assert blob.payload.nbytes == len(payload)
    assert _decode(blob.to_bytes(), len(payload)) == payload


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lz4", [False, True])
def test_fp8_keeps_k_exact_and_bounds_the_v_error(dtype: torch.dtype, lz4: bool) -> None:
    pairs, run_elems = 24, 128
    kv = _kv_tensor(pairs, run_elems, dtype)
    name = str(dtype).removeprefix("torch.")
    options = CodecOptions(lz4=lz4, fp8_values=True, dtype=name, run_elems=run_elems)  # type: ignore[arg-type]
    payload = _tensor_bytes(kv)
    blob = codec.encode(KEY, FP, payload, options)
    esize = kv.element_size()
    assert blob.payload.nbytes <= pairs * (4 + run_elems * esize + run_elems)  # V shrank to 1 byte
    back = _from_bytes(_decode(blob.to_bytes(), len(payload)), dtype, (pairs, 2, run_elems))

    assert torch.equal(back[:, 0], kv[:, 0])  # K byte-exact
    v, v_back = kv[:, 1].float(), back[:, 1].float()
    scale = v.abs().amax(dim=1, keepdim=True) / fp8.FP8_MAX
    out_rounding = {torch.float16: 2**-10, torch.bfloat16: 2**-7, torch.float32: 0.0}[dtype]
    bound = v.abs() * (2**-4 + out_rounding) + scale * 2**-9
    assert bool(((v_back - v).abs() <= bound).all())
    # and it is not a no-op: V really was quantized
    assert not torch.equal(back[:, 1], kv[:, 1])


def test_fp8_all_zero_runs_decode_to_zero() -> None:
    kv = torch.zeros(3, 2, 64, dtype=torch.float16)
    kv[:, 0] = 1.5
    options = CodecOptions(fp8_values=True, dtype="float16", run_elems=64)
    blob = codec.encode(KEY, FP, _tensor_bytes(kv), options)
    back = _from_bytes(_decode(blob.to_bytes(), kv.numel() * 2), torch.float16, (3, 2, 64))
    assert torch.equal(back, kv)


def test_fp8_needs_whole_run_pairs_and_a_run_length() -> None:
    with pytest.raises(ValueError, match="run_elems"):
        CodecOptions(fp8_values=True)
    with pytest.raises(ValueError, match="whole number"):
        codec.encode(KEY, FP, bytes(100), CodecOptions(fp8_values=True, dtype="float16", run_elems=8))


def test_encode_refuses_bad_fingerprint_and_oversized_key() -> None:
    with pytest.raises(ValueError, match="fingerprint"):
        codec.encode(KEY, b"short", b"x", CodecOptions())
    with pytest.raises(ValueError, match="key"):
        codec.encode("k" * 70_000, FP, b"x", CodecOptions())


@settings(max_examples=60, deadline=None)
@given(
    payload=st.binary(max_size=4096),
    key=st.text(min_size=1, max_size=80),
    fp=st.binary(min_size=8, max_size=8),
    lz4=st.booleans(),
)
def test_round_trip_property(payload: bytes, key: str, fp: bytes, lz4: bool) -> None:
    blob = codec.encode(key, fp, payload, CodecOptions(lz4=lz4))
    assert blob.nbytes == len(blob.to_bytes())
    assert _decode(blob.to_bytes(), len(payload), key, fp) == payload


@settings(max_examples=30, deadline=None)
@given(
    pairs=st.integers(0, 6),
    run_elems=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    lz4=st.booleans(),
)
def test_fp8_round_trip_property(pairs: int, run_elems: int, seed: int, lz4: bool) -> None:
    kv = _kv_tensor(max(pairs, 1), run_elems, torch.bfloat16, seed)[:pairs]
    payload = _tensor_bytes(kv)
    options = CodecOptions(lz4=lz4, fp8_values=True, dtype="bfloat16", run_elems=run_elems)
    blob = codec.encode(KEY, FP, payload, options)
    back = _from_bytes(_decode(blob.to_bytes(), len(payload)) + b"\0\0", torch.bfloat16, (-1,))
    back = back[: kv.numel()].view(kv.shape)
    assert torch.equal(back[:, 0], kv[:, 0])


# --- every corruption is caught -----------------------------------------------------------------


@pytest.fixture(params=[CodecOptions(), CodecOptions(lz4=True)], ids=["raw", "lz4"])
def blob_bytes(request: pytest.FixtureRequest) -> bytes:
    payload = bytes(range(256)) * 16 + os.urandom(512)
    return codec.encode(KEY, FP, payload, request.param).to_bytes()


def _orig_len(blob: bytes) -> int:
    return blob_header.read_header(blob).orig_len


def test_every_single_byte_flip_is_caught(blob_bytes: bytes) -> None:
    size = _orig_len(blob_bytes)
    for position in range(len(blob_bytes)):
        damaged = bytearray(blob_bytes)
        damaged[position] ^= 0x01
        with pytest.raises(IntegrityError):
            _decode(damaged, size)


def test_truncations_and_trailing_bytes_are_caught(blob_bytes: bytes) -> None:
    size = _orig_len(blob_bytes)
    for cut in (
        0,
        3,
        blob_header.HEADER_FIXED_SIZE - 1,
        blob_header.HEADER_FIXED_SIZE + 5,
        len(blob_bytes) - 1,
    ):
        with pytest.raises(IntegrityError):
            _decode(blob_bytes[:cut], size)
    with pytest.raises(IntegrityError):
        _decode(blob_bytes + b"\0", size)


def test_wrong_key_fingerprint_or_output_size_is_caught(blob_bytes: bytes) -> None:
    size = _orig_len(blob_bytes)
    with pytest.raises(IntegrityError, match="key"):
        _decode(blob_bytes, size, key=KEY + "x")
    with pytest.raises(IntegrityError, match="fingerprint"):
        _decode(blob_bytes, size, fp=bytes(8))
    with pytest.raises(IntegrityError, match="output"):
        _decode(blob_bytes, size + 1)
    with pytest.raises(ValueError, match="writable"):
        codec.decode_into(blob_bytes, KEY, FP, bytes(size))


def _resealed(blob: bytes, offset: int, fmt: str, value: int) -> bytes:
    """The blob with one header field changed and the header checksum recomputed."""
    damaged = bytearray(blob)
    struct.pack_into(fmt, damaged, offset, value)
    end = blob_header.header_length(damaged) - 8
    struct.pack_into("<Q", damaged, end, xxhash.xxh3_64_intdigest(bytes(damaged[:end])))
    return bytes(damaged)


def test_wrong_magic_version_or_flags_are_caught_even_with_a_valid_checksum(blob_bytes: bytes) -> None:
    size = _orig_len(blob_bytes)
    with pytest.raises(IntegrityError, match="magic"):
        _decode(b"KVD1" + blob_bytes[4:], size)
    with pytest.raises(IntegrityError, match="version"):
        _decode(_resealed(blob_bytes, 4, "<H", blob_header.VERSION + 1), size)
    with pytest.raises(IntegrityError, match="flags"):
        _decode(_resealed(blob_bytes, 6, "<H", 0x80), size)
    # lengths that lie, consistently sealed
    with pytest.raises(IntegrityError):
        _decode(_resealed(blob_bytes, ORIG_LEN_AT, "<Q", size + 1), size + 1)
    enc_len = blob_header.read_header(blob_bytes).enc_len
    with pytest.raises(IntegrityError, match="header says"):
        _decode(_resealed(blob_bytes, ORIG_LEN_AT + 8, "<Q", enc_len - 1), size)


def test_read_header_checks_the_header_alone(blob_bytes: bytes) -> None:
    header_len = blob_header.header_length(blob_bytes[: blob_header.HEADER_FIXED_SIZE])
    header = blob_header.read_header(blob_bytes[:header_len])
    assert header.total_len == len(blob_bytes)
    damaged = bytearray(blob_bytes[:header_len])
    damaged[-1] ^= 0xFF
    with pytest.raises(IntegrityError, match="checksum"):
        blob_header.read_header(damaged)
    with pytest.raises(IntegrityError, match="truncated"):
        blob_header.read_header(blob_bytes[: header_len - 1])
