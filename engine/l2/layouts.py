"""What the L2 codec needs to know about a layout kind: where the K and V runs of a chunk are.

A chunk's bytes are whatever the engine-side connector copied; FP8 quantization of V is only
possible for layout kinds whose chunks alternate equal K and V runs. Kinds not listed here are
stored exactly (FP8 is skipped for them, never guessed).
"""

from __future__ import annotations

from collections.abc import Callable

from engine.keys import KVLayout
from engine.results import Registration
from storage import codec

#: layout kind -> elements per K (and per V) run of a chunk
KV_RUNS: dict[str, Callable[[KVLayout], int]] = {
    # vLLM's CPU attention: per block and kv head, K^T [head_dim, block] then V [block, head_dim].
    "vllm-cpu": lambda lay: lay.head_dim * lay.block_size,
    # Chunks laid out per layer as K of all tokens then V of all tokens.
    "layer-kv": lambda lay: lay.chunk_size * lay.num_kv_heads * lay.head_dim,
}

_CODEC_DTYPES = {"float16", "bfloat16", "float32"}


def codec_options(reg: Registration, *, fp8_values: bool, lz4: bool) -> codec.CodecOptions:
    layout = reg.layout
    runs = KV_RUNS.get(layout.kind)
    if fp8_values and runs is not None and layout.dtype in _CODEC_DTYPES:
        return codec.CodecOptions(lz4=lz4, fp8_values=True, dtype=layout.dtype, run_elems=runs(layout))  # type: ignore[arg-type]
    return codec.CodecOptions(lz4=lz4)
