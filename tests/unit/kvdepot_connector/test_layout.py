from __future__ import annotations

import pytest
import torch

from engine.keys import KVLayout
from kvdepot_connector import layout
from kvdepot_connector.layout import ChunkFormat
from kvdepot_connector.protocol import Layout


@pytest.mark.parametrize("dtype", sorted(layout.DTYPE_SIZES))
def test_dtype_sizes_are_torchs(dtype: str) -> None:
    assert layout.dtype_size(dtype) == torch.tensor([], dtype=getattr(torch, dtype)).element_size()


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported dtype 'float64'"):
        layout.dtype_size("float64")
    with pytest.raises(ValueError, match="unsupported dtype"):
        layout.canonical_dtype("fp8_inc")


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("torch.bfloat16", "bfloat16"), ("half", "float16"), ("float", "float32"), ("fp8", "float8_e4m3fn"),
     ("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2"), ("float16", "float16")],
)  # fmt: skip
def test_engine_spellings_map_to_layout_dtypes(name: str, dtype: str) -> None:
    assert layout.canonical_dtype(name) == dtype


def test_engine_and_sidecar_agree_on_chunk_bytes() -> None:
    dims = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 32, "chunk_size": 32}
    expected = 2 * 4 * 2 * 32 * 32 * 2  # K and V, layers, heads, head dim, tokens, float16
    assert layout.chunk_bytes("float16", **dims) == expected
    wire = Layout(dtype="float16", block_size=16, kind="k", **dims)
    sidecar = KVLayout("float16", 4, 2, 32, 16, "k", 32)
    assert wire.chunk_bytes == sidecar.chunk_bytes == expected
    assert layout.chunk_bytes("float8_e5m2", **dims) == expected // 2


def test_blocks_per_chunk() -> None:
    assert layout.blocks_per_chunk(256, 16) == 16
    assert layout.blocks_per_chunk(128, 128) == 1
    for chunk, block in ((200, 128), (64, 0), (0, 16), (16, 32)):
        with pytest.raises(ValueError, match="multiple"):
            layout.blocks_per_chunk(chunk, block)


def test_kv_runs_only_for_known_kinds() -> None:
    dims = {"num_kv_heads": 2, "head_dim": 64, "block_size": 16, "chunk_size": 256}
    assert layout.kv_run_elems(layout.KIND_VLLM_CPU, **dims) == 64 * 16
    assert layout.kv_run_elems(layout.KIND_LAYER_KV, **dims) == 256 * 2 * 64
    assert layout.kv_run_elems(layout.KIND_VLLM_PAGED, **dims) is None
    assert layout.kv_run_elems("something-else", **dims) is None


def test_chunk_format_sizes_and_spans() -> None:
    fmt = ChunkFormat((100, 100, 40), blocks_per_chunk=2)
    assert fmt.chunk_bytes == 480
    assert fmt.spans() == [(0, 200), (200, 200), (400, 80)]
    fmt.check(480)
    with pytest.raises(ValueError, match=r"make chunks of 480 bytes .* not 481"):
        fmt.check(481)
    for planes, bpc in (((), 2), ((100, 0), 2), ((100,), 0)):
        with pytest.raises(ValueError, match="positive"):
            ChunkFormat(planes, bpc)


def test_block_pairs_of_a_load_use_absolute_chunks_and_skip() -> None:
    fmt = ChunkFormat((8,), blocks_per_chunk=2)
    block_ids = [10, 11, 12, 13, 14, 15]
    # Chunks 1 and 2 of the request into blocks 12..15; the request's first 3 blocks are skipped.
    assert fmt.block_pairs([1, 2], block_ids, skip_blocks=3) == [(0, 1, 13), (1, 0, 14), (1, 1, 15)]
    assert fmt.block_pairs([], block_ids) == []


def test_block_pairs_refuse_block_ids_that_do_not_cover_the_chunks() -> None:
    fmt = ChunkFormat((8,), blocks_per_chunk=2)
    with pytest.raises(ValueError, match="3 block ids do not cover chunk 1"):
        fmt.block_pairs([0, 1], [1, 2, 3])
    with pytest.raises(ValueError, match="do not cover chunk -1"):
        fmt.block_pairs([-1], [1, 2, 3])


def test_a_chunk_scattered_into_blocks_and_gathered_back_is_unchanged() -> None:
    """The copy plan both sides use: chunk -> blocks of two planes of different widths -> chunk."""
    fmt = ChunkFormat((4, 6), blocks_per_chunk=3)
    planes = [torch.zeros(8, 4, dtype=torch.uint8), torch.zeros(8, 6, dtype=torch.uint8)]
    chunk = torch.arange(fmt.chunk_bytes, dtype=torch.uint8)
    block_ids = [7, 2, 5]

    def cut(region: torch.Tensor) -> list[torch.Tensor]:
        return [region[pos : pos + n].view(fmt.blocks_per_chunk, -1) for pos, n in fmt.spans()]

    for _, j, block in fmt.block_pairs([0], block_ids):
        for plane, src in zip(planes, cut(chunk), strict=True):
            plane[block].copy_(src[j])
    assert planes[0][7].tolist() == [0, 1, 2, 3] and planes[1][7].tolist() == list(range(12, 18))
    back = torch.zeros_like(chunk)
    for i, j, block in fmt.block_pairs([0], block_ids):
        assert i == 0
        for plane, dst in zip(planes, cut(back), strict=True):
            dst[j].copy_(plane[block])
    assert torch.equal(back, chunk)
