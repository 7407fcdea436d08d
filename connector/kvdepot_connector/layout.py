"""KV layout arithmetic, defined once for the engine side and the sidecar.

Pure: only the standard library, so every package of the sidecar may import it (as it imports
`protocol`) without pulling in torch or zmq. No state.

Primitives:
  dtype_size(dtype), canonical_dtype(name)   the KV element types a layout may name, their sizes,
                                             and the other spellings engines use for them
  chunk_bytes(...), blocks_per_chunk(...)    sizes of a chunk: K and V of every layer
  kv_run_elems(kind, ...)                    where a layout kind keeps a chunk's K and V runs
  ChunkFormat                                a chunk's bytes as the engine's paged KV blocks:
    .check(nbytes)                             the planes add up to a chunk of that size
    .spans()                                   where each plane's blocks lie in a chunk
    .block_pairs(chunks, block_ids, skip)      which engine block goes to which block of which chunk

The chunk format: a chunk holds `blocks_per_chunk` blocks of every KV plane (one plane per layer,
or one per K and V where the engine keeps them apart), plane-major: plane 0's blocks in order,
then plane 1's, and so on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: bytes per element of every dtype a layout may name
DTYPE_SIZES: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}

# Other spellings of the same dtypes (vLLM's --kv-cache-dtype and --dtype values).
_ALIASES = {
    "half": "float16",
    "float": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}

#: layout kinds whose chunk arrangement the sidecar knows (others are stored as opaque bytes)
KIND_VLLM_CPU = "vllm-cpu"  # vLLM's CPU attention: per block and kv head, K^T [head_dim, block], V
KIND_VLLM_PAGED = "vllm-paged"  # vLLM's GPU paged KV cache
KIND_LAYER_KV = "layer-kv"  # per layer, K of all the chunk's tokens, then V of all of them


def dtype_size(dtype: str) -> int:
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; one of {sorted(DTYPE_SIZES)}") from None


def canonical_dtype(name: str) -> str:
    """The layout's name for a dtype spelled `name` ("torch.float16", "half", "fp8", ...)."""
    bare = name.removeprefix("torch.")
    bare = _ALIASES.get(bare, bare)
    dtype_size(bare)
    return bare


def chunk_bytes(dtype: str, *, num_layers: int, num_kv_heads: int, head_dim: int, chunk_size: int) -> int:
    """Bytes of one chunk: K and V of every layer for `chunk_size` tokens."""
    return 2 * num_layers * num_kv_heads * head_dim * chunk_size * dtype_size(dtype)


def blocks_per_chunk(chunk_size: int, block_size: int) -> int:
    if block_size <= 0 or chunk_size <= 0 or chunk_size % block_size:
        raise ValueError(
            f"chunk_size {chunk_size} must be a positive multiple of the engine block size {block_size}"
        )
    return chunk_size // block_size


def kv_run_elems(
    kind: str, *, num_kv_heads: int, head_dim: int, block_size: int, chunk_size: int
) -> int | None:
    """Elements per K (and per V) run of a chunk of layout `kind`, for kinds whose chunks alternate
    equal K and V runs; None for any other kind (its chunks are opaque bytes)."""
    if kind == KIND_VLLM_CPU:
        return head_dim * block_size
    if kind == KIND_LAYER_KV:
        return chunk_size * num_kv_heads * head_dim
    return None


BlockPair = tuple[int, int, int]  # (chunk position in the caller's list, block in the chunk, engine block)


@dataclass(frozen=True, slots=True)
class ChunkFormat:
    """How a chunk's bytes map onto the engine's KV planes, each indexed by block."""

    plane_block_bytes: tuple[int, ...]  # bytes of one block, per plane
    blocks_per_chunk: int

    def __post_init__(self) -> None:
        if not self.plane_block_bytes or any(b <= 0 for b in self.plane_block_bytes):
            raise ValueError("a chunk format needs at least one KV plane of positive block size")
        if self.blocks_per_chunk <= 0:
            raise ValueError("blocks_per_chunk must be positive")

    @property
    def chunk_bytes(self) -> int:
        return sum(self.plane_block_bytes) * self.blocks_per_chunk

    def check(self, nbytes: int) -> None:
        """Raise ValueError unless a chunk of this format has `nbytes` bytes."""
        if nbytes != self.chunk_bytes:
            raise ValueError(
                f"{len(self.plane_block_bytes)} KV planes of {list(self.plane_block_bytes)} bytes per block "
                f"make chunks of {self.chunk_bytes} bytes ({self.blocks_per_chunk} blocks), not {nbytes}"
            )

    def spans(self) -> list[tuple[int, int]]:
        """(offset, length) in a chunk of each plane's blocks, in plane order."""
        out = []
        pos = 0
        for width in self.plane_block_bytes:
            out.append((pos, width * self.blocks_per_chunk))
            pos += width * self.blocks_per_chunk
        return out

    def block_pairs(
        self, chunks: Sequence[int], block_ids: Sequence[int], *, skip_blocks: int = 0
    ) -> list[BlockPair]:
        """For the chunks at positions 0.. of a caller's list, chunk `chunks[i]` of `block_ids`
        (its blocks are block_ids[chunks[i] * blocks_per_chunk ...]): (i, j, block id) for each of
        its blocks j, leaving out positions in `block_ids` before `skip_blocks`."""
        bpc = self.blocks_per_chunk
        pairs: list[BlockPair] = []
        for i, chunk in enumerate(chunks):
            base = chunk * bpc
            if chunk < 0 or base + bpc > len(block_ids):
                raise ValueError(f"{len(block_ids)} block ids do not cover chunk {chunk} of {bpc} blocks")
            pairs.extend((i, j, block_ids[base + j]) for j in range(bpc) if base + j >= skip_blocks)
        return pairs
