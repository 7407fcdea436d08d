"""storage/codec/fp8.py (numpy + ml_dtypes) against torch's conversions: the same bytes for every value
but NaN, whose bits torch itself leaves undefined (a NaN must stay a NaN).

The reference below is the torch implementation the codec used before; blobs written by either
decode to the same bytes with the other.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from storage.codec import fp8

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
BITS = {"float16": np.uint16, "bfloat16": np.uint16, "float32": np.uint32}


def torch_encode(raw: bytes, dtype: str, run_elems: int) -> bytes:
    tdt = TORCH_DTYPES[dtype]
    run_bytes = run_elems * tdt.itemsize
    pairs = len(raw) // (2 * run_bytes)
    src = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(pairs, 2, run_bytes)
    values = src[:, 1, :].contiguous().view(tdt).float()
    scales = torch.maximum(values.amax(dim=1), -values.amin(dim=1)) / fp8.FP8_MAX
    scales[~(scales > 0)] = 1.0
    values /= scales[:, None]
    values.clamp_(-fp8.FP8_MAX, fp8.FP8_MAX)
    v8 = values.to(torch.float8_e4m3fn).view(torch.uint8)
    parts = [scales.view(torch.uint8), src[:, 0, :].reshape(-1), v8]
    return b"".join(bytes(p.reshape(-1).numpy()) for p in parts)


def torch_decode(body: bytes, dtype: str, run_elems: int, size: int) -> bytes:
    tdt = TORCH_DTYPES[dtype]
    run_bytes = run_elems * tdt.itemsize
    pairs = size // (2 * run_bytes)
    src = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    k_end = pairs * (4 + run_bytes)
    out = torch.empty(pairs, 2, run_bytes, dtype=torch.uint8)
    out[:, 0, :] = src[pairs * 4 : k_end].view(pairs, run_bytes)
    scales = src[: pairs * 4].view(torch.float32)
    values = src[k_end:].view(torch.float8_e4m3fn).float().view(pairs, run_elems) * scales[:, None]
    out.view(tdt)[:, 1, :].copy_(values)
    return bytes(out.view(-1).numpy())


def assert_same_values(ours: bytes, theirs: bytes, dtype: str) -> None:
    """Bit-identical but for NaN, which must be NaN on both sides."""
    a = np.frombuffer(ours, dtype=BITS[dtype])
    b = np.frombuffer(theirs, dtype=BITS[dtype])
    t = torch.from_numpy(b.copy()).view(TORCH_DTYPES[dtype])
    nan = torch.isnan(t).numpy()
    ours_nan = torch.isnan(torch.from_numpy(a.copy()).view(TORCH_DTYPES[dtype])).numpy()
    assert np.array_equal(nan, ours_nan)
    assert np.array_equal(a[~nan], b[~nan])


def kv_bytes(values: np.ndarray, dtype: str, run_elems: int, seed: int = 0) -> bytes:
    """Pairs of (K run, V run); V holds `values` (float32, padded to whole runs), K random."""
    rng = np.random.default_rng(seed)
    pairs = -(-values.size // run_elems)
    v = np.zeros(pairs * run_elems, np.float32)
    v[: values.size] = values
    kv = np.empty((pairs, 2, run_elems), np.float32)
    kv[:, 0, :] = rng.standard_normal((pairs, run_elems))
    kv[:, 1, :] = v.reshape(pairs, run_elems)
    return bytes(torch.from_numpy(kv).to(TORCH_DTYPES[dtype]).view(torch.uint8).reshape(-1).numpy())


def every_bit_pattern(dtype: str) -> np.ndarray:
    """Every value of a 16-bit dtype as float32 (exact), NaN patterns left out."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = torch.from_numpy(bits).view(TORCH_DTYPES[dtype]).float().numpy()
    return values[~np.isnan(values)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("run_elems", [64, 127])
def test_every_value_of_the_dtype_encodes_and_decodes_like_torch(dtype: str, run_elems: int) -> None:
    values = every_bit_pattern(dtype)
    np.random.default_rng(1).shuffle(values)  # runs of mixed magnitudes: every scale case
    raw = kv_bytes(values, dtype, run_elems)
    ours = bytes(fp8.encode(memoryview(raw), dtype, run_elems))
    assert ours == torch_encode(raw, dtype, run_elems)
    back = bytearray(len(raw))
    fp8.decode(memoryview(ours), dtype, run_elems, memoryview(back))
    assert_same_values(bytes(back), torch_decode(ours, dtype, run_elems, len(raw)), dtype)


def test_float32_values_at_every_e4m3_rounding_boundary_encode_like_torch() -> None:
    """Every e4m3 value, the midpoints between neighbours (ties to even) and the float32 values
    either side of each midpoint, under scales that keep them where they are (runs whose absmax is
    448) and random float32 values besides."""
    e4m3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    grid = np.unique(e4m3[np.isfinite(e4m3)]).astype(np.float64)
    mids = ((grid[:-1] + grid[1:]) / 2).astype(np.float32)
    near = [mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))]
    edges = np.concatenate([grid.astype(np.float32), *near])
    run_elems = 63
    pairs = -(-edges.size // run_elems)
    v = np.zeros((pairs, run_elems + 1), np.float32)
    v[:, 0] = 448.0  # scale 1.0: each run's values are converted as they are
    v[:, 1:].reshape(-1)[: edges.size] = edges
    rng = np.random.default_rng(2)
    random = (rng.standard_normal(64 * 4096) * np.exp(rng.uniform(-20, 20, 64 * 4096))).astype(np.float32)
    for values, n in ((v.reshape(-1), run_elems + 1), (random, 64)):
        raw = kv_bytes(values, "float32", n)
        ours = bytes(fp8.encode(memoryview(raw), "float32", n))
        assert ours == torch_encode(raw, "float32", n)
        back = bytearray(len(raw))
        fp8.decode(memoryview(ours), "float32", n, memoryview(back))
        assert_same_values(bytes(back), torch_decode(ours, "float32", n, len(raw)), "float32")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_infinities_zeros_and_nans_match_torch_and_nan_stays_nan(dtype: str) -> None:
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1.0, -3.5, 1e-8, 6e4], np.float32)
    rng = np.random.default_rng(3)
    values = np.concatenate([special, rng.choice(special, 500), rng.standard_normal(500).astype(np.float32)])
    for run_elems in (4, 16, 1010):
        raw = kv_bytes(values, dtype, run_elems)
        ours = bytes(fp8.encode(memoryview(raw), dtype, run_elems))
        theirs = torch_encode(raw, dtype, run_elems)
        assert ours == theirs  # encode's e4m3 bytes are exact, NaN included
        back = bytearray(len(raw))
        fp8.decode(memoryview(ours), dtype, run_elems, memoryview(back))
        assert_same_values(bytes(back), torch_decode(ours, dtype, run_elems, len(raw)), dtype)


def test_blobs_written_with_torch_decode_with_numpy_and_back() -> None:
    rng = np.random.default_rng(4)
    raw = kv_bytes((rng.standard_normal(8 * 128) * 3).astype(np.float32), "bfloat16", 128)
    theirs = torch_encode(raw, "bfloat16", 128)
    back = bytearray(len(raw))
    fp8.decode(memoryview(theirs), "bfloat16", 128, memoryview(back))
    assert bytes(back) == torch_decode(theirs, "bfloat16", 128, len(raw))
