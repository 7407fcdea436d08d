"""What the L2 codec needs to know about a registered layout: where the K and V runs of a chunk are.

A chunk's bytes are whatever the engine-side connector copied; FP8 quantization of V is only
possible for layout kinds whose chunks alternate equal K and V runs (`kvdepot_connector.layout.
kv_run_elems`) and for the value dtypes the codec widens. Other layouts are stored exactly (FP8 is
skipped for them, never guessed).
"""

from __future__ import annotations

from typing import get_args

from engine.results import Registration
from kvdepot_connector.layout import kv_run_elems
from storage import codec
from storage.codec import blob_header

_CODEC_DTYPES: frozenset[str] = frozenset(get_args(blob_header.ValueDtype))


def codec_options(reg: Registration, *, fp8_values: bool, lz4: bool) -> codec.CodecOptions:
    lay = reg.layout
    runs = kv_run_elems(
        lay.kind, num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim, block_size=lay.block_size,
        chunk_size=lay.chunk_size,
    )  # fmt: skip
    if fp8_values and runs is not None and lay.dtype in _CODEC_DTYPES:
        return codec.CodecOptions(lz4=lz4, fp8_values=True, dtype=lay.dtype, run_elems=runs)  # type: ignore[arg-type]
    return codec.CodecOptions(lz4=lz4)
