"""The engine side of `kvdepot bench copies`: KV planes laid out like vLLM's paged cache, shared with
the sidecar, filled with known bytes, and the baseline copies (the client's own `copy_`).

State: `Planes` owns the KV memory (on CUDA one `[2, blocks, block_tokens, kv_heads, head_dim]`
tensor per layer, as vLLM allocates it; on CPU one sealed memfd region holding all of them, the
only CPU memory the sidecar may open), its planes (K and V of every layer, block-indexed), the
known bytes written into the source blocks (`expected`, on the host) and the baseline's host
buffer (pinned on CUDA). One thread (the benchmark's) touches it.

Primitives in call order: `cuda_missing()` (why `--device cuda` cannot run, or None),
`Planes(shape, device)`, `.handles()` / `.region()`, `.fill(blocks, seed)`, `.baseline_save(chunks)`,
`.baseline_load(chunks)`, `.clear(blocks)`, `.loaded_equal(src, dst)`, `.l1_equal(views)`, `.close()`.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvdepot_connector.handles import SharedTensor, export_tensor
from kvdepot_connector.protocol import TensorHandle

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: what `--device cuda` needs, said when it is missing
CUDA_NEEDS = (
    "torch built with CUDA and a visible NVIDIA GPU (torch.cuda.is_available() true); "
    "run `kvdepot bench copies --device cpu` for the CPU path (sealed memfd regions)"
)


def cuda_missing() -> str | None:
    """Why this process cannot run the CUDA mode, or None when it can."""
    cuda = torch.version.cuda
    if cuda is None:
        return f"torch {torch.__version__} is built without CUDA; --device cuda needs {CUDA_NEEDS}"
    if not torch.cuda.is_available():
        return (
            f"torch {torch.__version__} (CUDA {cuda}) sees no GPU "
            f"(CUDA_VISIBLE_DEVICES={_visible()!r}); --device cuda needs {CUDA_NEEDS}"
        )
    return None


def _visible() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


@dataclass(frozen=True, slots=True)
class Shape:
    """vLLM's paged layout: per layer K and V planes of `blocks` blocks."""

    layers: int
    blocks: int
    block_tokens: int
    kv_heads: int
    head_dim: int
    dtype: str
    chunk_tokens: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one plane."""
        size = torch.tensor([], dtype=DTYPES[self.dtype]).element_size()
        return self.block_tokens * self.kv_heads * self.head_dim * size

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_tokens

    @property
    def planes(self) -> int:
        return 2 * self.layers

    @property
    def chunk_bytes(self) -> int:
        return self.planes * self.blocks_per_chunk * self.block_bytes


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Planes:
    def __init__(self, shape: Shape, device: str, chunks: int) -> None:
        self.shape, self.device = shape, device
        layer = (2, shape.blocks, shape.block_tokens, shape.kv_heads, shape.head_dim)
        dtype = DTYPES[shape.dtype]
        self.shared: SharedTensor | None = None
        if device == "cuda":
            self.layers = [torch.zeros(layer, dtype=dtype, device="cuda") for _ in range(shape.layers)]
        else:
            self.shared = SharedTensor((shape.layers, *layer), dtype)
            self.layers = [self.shared.tensor[i] for i in range(shape.layers)]
        #: K and V of every layer, in the order they are registered (the chunk's plane order)
        self.planes = [layer[kv] for layer in self.layers for kv in (0, 1)]
        self._rows = [p.view(torch.uint8).view(shape.blocks, -1) for p in self.planes]
        pinned = device == "cuda"
        self.host = torch.empty((chunks, shape.chunk_bytes), dtype=torch.uint8, pin_memory=pinned)
        self.host.fill_(0)  # touched: the baseline copies into memory as warm as the pinned arena
        self.expected = torch.empty(0, dtype=torch.uint8)

    def handles(self) -> list[TensorHandle]:
        return [export_tensor(p, self.shared) for p in self.planes]

    def region(self) -> tuple[str, int, int] | None:
        """The sealed region to share over the lifeline (CPU), or None (CUDA IPC needs none)."""
        return None if self.shared is None else self.shared.region()

    def fill(self, blocks: Sequence[int], seed: int) -> None:
        """Write random bytes (CPU generator `seed`: the same whatever the device) into `blocks` of
        every plane; `expected` keeps them as [planes, blocks, block bytes]."""
        g = torch.Generator().manual_seed(seed)
        n, bb = len(blocks), self.shape.block_bytes
        self.expected = torch.randint(0, 256, (len(self.planes), n, bb), generator=g, dtype=torch.uint8)
        ids = torch.tensor(list(blocks), device=self.planes[0].device)
        for rows, want in zip(self._rows, self.expected, strict=True):
            rows[ids] = want.to(rows.device)
        _sync(self.device)

    def _runs(self, chunk: int, blocks: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(host part, plane rows) of chunk `chunk` of `blocks` (consecutive ids), plane-major as
        the sidecar lays a chunk out in L1."""
        bpc, bb = self.shape.blocks_per_chunk, self.shape.block_bytes
        first = blocks[chunk * bpc]
        out = []
        for i, rows in enumerate(self._rows):
            part = self.host[chunk, i * bpc * bb : (i + 1) * bpc * bb].view(bpc, bb)
            out.append((part, rows[first : first + bpc]))
        return out

    def baseline_save(self, chunks: int, blocks: Sequence[int]) -> float:
        """Seconds the client's own copies of the chunks' blocks into the host buffer take: one
        `copy_` per chunk and plane (the runs the sidecar copies), then synchronised."""
        _sync(self.device)
        started = time.perf_counter()
        for c in range(chunks):
            for part, rows in self._runs(c, blocks):
                part.copy_(rows, non_blocking=True)
        _sync(self.device)
        return time.perf_counter() - started

    def baseline_load(self, chunks: int, blocks: Sequence[int]) -> float:
        """Seconds the copies back from the host buffer into `blocks` take."""
        _sync(self.device)
        started = time.perf_counter()
        for c in range(chunks):
            for part, rows in self._runs(c, blocks):
                rows.copy_(part, non_blocking=True)
        _sync(self.device)
        return time.perf_counter() - started

    def clear(self, blocks: Sequence[int]) -> None:
        """Zero `blocks` of every plane (so that a load that copied nothing is caught)."""
        ids = torch.tensor(list(blocks), device=self.planes[0].device)
        for rows in self._rows:
            rows[ids] = 0
        _sync(self.device)

    def loaded_equal(self, src: Sequence[int], dst: Sequence[int]) -> bool:
        """Every byte of `dst` equals the known bytes written into `src`."""
        _sync(self.device)
        ids = torch.tensor(list(dst), device=self.planes[0].device)
        return len(src) == len(dst) and all(
            torch.equal(rows[ids].cpu(), want) for rows, want in zip(self._rows, self.expected, strict=True)
        )

    def l1_chunk(self, chunk: int) -> torch.Tensor:
        """The bytes chunk `chunk` of the filled blocks must have in L1 (plane-major)."""
        bpc = self.shape.blocks_per_chunk
        return self.expected[:, chunk * bpc : (chunk + 1) * bpc].reshape(-1)

    def l1_digest(self, views: Sequence[torch.Tensor]) -> tuple[bool, str]:
        """Whether the L1 views of the saved chunks hold the known bytes, and their sha256."""
        digest = hashlib.sha256()
        equal = True
        for i, view in enumerate(views):
            got = view.reshape(-1)
            equal = equal and torch.equal(got, self.l1_chunk(i))
            digest.update(got.numpy().data)
        return equal, digest.hexdigest()

    def close(self) -> None:
        self.planes.clear()
        self._rows.clear()
        self.layers.clear()
        if self.shared is not None:
            self.shared.close()
        if self.device == "cuda":
            torch.cuda.empty_cache()
