"""KVTransfers: the sidecar copies between an engine's paged KV blocks and L1 itself.

Used where the engine can share its KV cache with the sidecar (CUDA IPC handles on a GPU; a
shared-memory region with the CPU stub): the engine then sends block ids instead of copying.

State: per registered engine, its KV planes opened by the device (one per layer, or per K/V plane
where they are separate), each viewed as [blocks, block bytes]. Owned by the event loop; the
copies themselves run through gpu.TransferEngine (a stream, an event awaited in an executor), so
the loop never blocks on them.

Primitives in call order:
  register(engine, handles)                     open, check against the engine's layout
  load(engine, request, first, n, blocks, skip) retrieve the request's locked chunks, copy them
                                                into the blocks, release -> False if a lease expired
  save(engine, request, tokens, salt, first, blocks) reserve, copy out of the blocks, commit
L1 memory stays locked (load) or reserved (save) until its copy has completed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from app.errors import InvalidInput, NotFound, TransferError
from engine.facade import CacheEngine
from engine.results import SlotStatus
from gpu.device import HandleError
from gpu.transfer import TransferEngine


@dataclass(frozen=True, slots=True)
class SaveOutcome:
    stored: int
    existing: int
    refused: int


class KVTransfers:
    def __init__(self, engine: CacheEngine, transfer: TransferEngine) -> None:
        self.engine = engine
        self.transfer = transfer
        self._planes: dict[int, list[torch.Tensor]] = {}

    def register(self, engine_id: int, handles: Sequence[dict[str, Any]]) -> int:
        reg = self.engine.registration(engine_id)
        device = self.transfer.device
        planes: list[torch.Tensor] = []
        try:
            for handle in handles:
                tensor = device.open(handle)
                if not tensor.is_contiguous():
                    raise InvalidInput("every KV plane must be contiguous")
                planes.append(tensor.view(torch.uint8).view(tensor.shape[0], -1))
        except HandleError as exc:
            raise InvalidInput(str(exc)) from None
        blocks = {p.shape[0] for p in planes}
        lay = reg.layout
        bpc = lay.chunk_size // lay.block_size
        if len(blocks) != 1 or sum(p.shape[1] for p in planes) * bpc != reg.chunk_bytes:
            raise InvalidInput(
                f"KV planes {[tuple(p.shape) for p in planes]} do not add up to the registered layout "
                f"({reg.chunk_bytes} bytes per chunk of {bpc} blocks)"
            )
        for old in self._planes.pop(engine_id, []):
            device.close(old)
        self._planes[engine_id] = planes
        return len(planes)

    def _layout(self, engine_id: int) -> tuple[list[torch.Tensor], int]:
        planes = self._planes.get(engine_id)
        if planes is None:
            raise NotFound(f"engine {engine_id} registered no KV cache (REGISTER_KV_CACHE first)")
        lay = self.engine.registration(engine_id).layout
        return planes, lay.chunk_size // lay.block_size

    def _chunk_view(self, offset: int, size: int, planes: list[torch.Tensor], bpc: int) -> list[torch.Tensor]:
        """The chunk's bytes in the arena, cut as [plane][block] views."""
        region = self.engine.arena.tensor(offset, size)
        out = []
        pos = 0
        for plane in planes:
            width = plane.shape[1]
            out.append(region[pos : pos + width * bpc].view(bpc, width))
            pos += width * bpc
        return out

    async def load(
        self, engine_id: int, request_id: str, *, first_chunk: int, num_chunks: int, block_ids: Sequence[int],
        skip_blocks: int = 0,
    ) -> bool:  # fmt: skip
        planes, bpc = self._layout(engine_id)
        if len(block_ids) < (first_chunk + num_chunks) * bpc:
            raise InvalidInput(f"{len(block_ids)} block ids for chunks up to {first_chunk + num_chunks}")
        self._check_blocks(block_ids, planes)
        extents = self.engine.retrieve(engine_id, request_id, first_chunk, num_chunks)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, ext in enumerate(extents):
            cut = self._chunk_view(ext.offset, ext.size, planes, bpc)
            base = (first_chunk + i) * bpc
            for j in range(bpc):
                if base + j < skip_blocks:
                    continue
                block = block_ids[base + j]
                pairs.extend((plane[block], src[j]) for plane, src in zip(planes, cut, strict=True))
        try:
            await self.transfer.run(pairs)
        except Exception as exc:
            self.engine.release(engine_id, request_id)
            raise TransferError(f"copy into the engine's blocks failed: {exc}") from None
        return self.engine.release(engine_id, request_id)

    async def save(
        self,
        engine_id: int,
        request_id: str,
        *,
        tokens: bytes,
        salt: str,
        first_chunk: int,
        block_ids: Sequence[int],
    ) -> SaveOutcome:
        planes, bpc = self._layout(engine_id)
        self._check_blocks(block_ids, planes)
        slots = self.engine.store(engine_id, request_id, tokens, salt, first_chunk)
        reserved = [s for s in slots if s.status is SlotStatus.RESERVED]
        if len(block_ids) < len(slots) * bpc:
            self.engine.abort(engine_id, [s.oid for s in reserved])
            raise InvalidInput(f"{len(block_ids)} block ids for {len(slots)} chunks of {bpc} blocks")
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for slot in reserved:
            cut = self._chunk_view(slot.offset, slot.size, planes, bpc)
            base = (slot.chunk - first_chunk) * bpc
            for j in range(bpc):
                block = block_ids[base + j]
                pairs.extend((dst[j], plane[block]) for plane, dst in zip(planes, cut, strict=True))
        try:
            await self.transfer.run(pairs)
        except Exception as exc:
            self.engine.abort(engine_id, [s.oid for s in reserved])
            raise TransferError(f"copy out of the engine's blocks failed: {exc}") from None
        committed = self.engine.commit(engine_id, [s.oid for s in reserved])
        existing = sum(1 for s in slots if s.status is SlotStatus.EXISTS)
        stored = sum(committed)
        return SaveOutcome(stored=stored, existing=existing, refused=len(slots) - existing - stored)

    @staticmethod
    def _check_blocks(block_ids: Sequence[int], planes: list[torch.Tensor]) -> None:
        limit = planes[0].shape[0]
        if any(b < 0 or b >= limit for b in block_ids):
            raise InvalidInput(f"block ids must be in 0..{limit - 1}")
