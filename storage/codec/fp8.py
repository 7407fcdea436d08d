"""FP8 (e4m3) quantization of the V runs of a payload: the codec's fp8_values encoding.

Stateless but for a 256-entry lookup table built on first use; pure functions, safe from any
thread, CPU-bound on large payloads (callers run them in an executor for big chunks).

The original payload is alternating K and V runs of `run_elems` elements of `dtype` (float16,
bfloat16 or float32). Encoded as [scales f32 x pairs | K runs | V runs as e4m3]: K runs are kept
exactly; each V run becomes float8_e4m3fn with one float32 scale per run (scale = absmax / FP8_MAX,
1.0 for an all-zero run). Lossy by design (storage/codec/__init__.py says by how much).

Primitives in call order:
  encode(raw, dtype, run_elems)          -> the encoded payload
  decode(body, dtype, run_elems, dest)   the original bytes into dest

Written to touch as little fresh memory as possible (on CPU, new pages cost more than the math):
V is widened to float32 once, scaled in place, narrowed to e4m3; decoding looks each e4m3 byte up
in the table, scales in place, and narrows straight into the output buffer.

numpy does the arithmetic and ml_dtypes the conversions numpy has no dtype for (e4m3, bfloat16):
no torch in the sidecar. Every finite value, and +-inf, encodes and decodes to the same bits as
torch's conversions (round to nearest even; tests/unit/storage/test_storage_fp8.py compares them);
a NaN decodes to a NaN, its bits are not defined (torch's own differ between its
vectorized and scalar paths).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

FP8_MAX = 448.0  # largest finite float8_e4m3fn

F32Array = np.ndarray[tuple[int, ...], np.dtype[np.float32]]
_E4M3_TABLE: list[F32Array] = []
_DTYPES: dict[str, np.dtype[Any]] = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
}
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def _e4m3_table() -> F32Array:
    """float32 value of each of the 256 float8_e4m3fn bit patterns."""
    if not _E4M3_TABLE:
        _E4M3_TABLE.append(np.arange(256, dtype=np.uint8).view(_E4M3).astype(np.float32))
    return _E4M3_TABLE[0]


def _widen(runs: np.ndarray[Any, np.dtype[np.uint8]], dtype: str) -> F32Array:
    """A new float32 array of the values in `runs` (pairs x run bytes, read-only is fine)."""
    if dtype == "float16":
        return runs.view(np.float16).astype(np.float32)
    if dtype == "float32":
        return runs.view(np.float32).astype(np.float32)
    wide = runs.view(np.uint16).astype(np.uint32)  # bfloat16 is the top half of a float32
    wide <<= 16
    return wide.view(np.float32)


def encode(raw: memoryview, dtype: str, run_elems: int) -> memoryview:
    """[scales f32 x pairs | K runs | V runs as e4m3] from alternating K and V runs (whole pairs)."""
    esize = _DTYPES[dtype].itemsize
    run_bytes = run_elems * esize
    pairs = raw.nbytes // (2 * run_bytes)
    out = np.empty(pairs * (4 + run_bytes + run_elems), dtype=np.uint8)
    if pairs == 0:
        return out.data
    src = np.frombuffer(raw, dtype=np.uint8).reshape(pairs, 2, run_bytes)
    k_end = pairs * (4 + run_bytes)
    out[pairs * 4 : k_end].reshape(pairs, run_bytes)[:] = src[:, 0, :]
    values = _widen(src[:, 1, :], dtype)
    with np.errstate(invalid="ignore"):  # NaN (a broken KV) is carried, not reported
        scales = np.maximum(values.max(axis=1), -values.min(axis=1)) / np.float32(FP8_MAX)
        scales[~(scales > 0)] = 1.0  # all-zero (or non-finite) runs
        values /= scales[:, None]
        np.clip(values, -FP8_MAX, FP8_MAX, out=values)
        out[: pairs * 4] = scales.view(np.uint8)
        out[k_end:].view(_E4M3)[:] = values.reshape(-1)
    return out.data


def decode(body: memoryview, dtype: str, run_elems: int, dest: memoryview) -> None:
    """Write the original bytes (K runs as stored, V runs scaled back and narrowed to `dtype`) into
    `dest`, whose size says how many run pairs there are."""
    target = _DTYPES[dtype]
    run_bytes = run_elems * target.itemsize
    pairs = dest.nbytes // (2 * run_bytes)
    if pairs == 0:
        return
    src = np.frombuffer(body, dtype=np.uint8)
    k_end = pairs * (4 + run_bytes)
    dst = np.frombuffer(dest, dtype=np.uint8).reshape(pairs, 2, run_bytes)
    dst[:, 0, :] = src[pairs * 4 : k_end].reshape(pairs, run_bytes)
    scales = src[: pairs * 4].view(np.float32)
    values = _e4m3_table()[src[k_end:].reshape(pairs, run_elems)]
    with np.errstate(over="ignore", invalid="ignore"):
        values *= scales[:, None]
        dst[:, 1, :].view(target)[:] = values  # narrows to dtype (round to nearest even)
