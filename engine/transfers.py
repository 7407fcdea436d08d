"""KVTransfers: the sidecar copies between an engine's paged KV blocks and L1 itself.

Used where the engine can share its KV cache with the sidecar (CUDA IPC handles on a GPU; a
shared-memory region with the CPU stub): the engine then sends block ids instead of copying.

State: per registered engine, its KV planes opened by the device (one per layer, or per K/V plane
where they are separate), each viewed as [blocks, block bytes], and their chunk format
(`kvdepot_connector.layout.ChunkFormat`: which block of which plane is where in a chunk). Owned
by the event loop; the copies themselves run through gpu.TransferEngine (a stream, an event
awaited in an executor), so the loop never blocks on them.

Engine ids are per engine instance (engine/registry.py), so two engines of one model never share
planes; `drop` lets the planes of a registration the registry dropped go.

Primitives in call order:
  register(engine, handles)                     open, check against the engine's layout
  load(engine, request, first, n, blocks, skip) retrieve the request's locked chunks, copy them
                                                into the blocks, release -> False if a lease expired
  save(engine, request, tokens, salt, first, blocks) reserve, copy out of the blocks, commit
  drop(engine)                                  the planes are closed
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
from kvdepot_connector.layout import ChunkFormat, blocks_per_chunk


@dataclass(frozen=True, slots=True)
class SaveOutcome:
    stored: int
    existing: int
    refused: int


class KVTransfers:
    def __init__(self, engine: CacheEngine, transfer: TransferEngine) -> None:
        self.engine = engine
        self.transfer = transfer
        self._planes: dict[int, tuple[list[torch.Tensor], ChunkFormat]] = {}

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
        if len({p.shape[0] for p in planes}) != 1:
            raise InvalidInput(f"KV planes {[tuple(p.shape) for p in planes]} differ in number of blocks")
        lay = reg.layout
        try:
            bpc = blocks_per_chunk(lay.chunk_size, lay.block_size)
            fmt = ChunkFormat(tuple(p.shape[1] for p in planes), bpc)
            fmt.check(reg.chunk_bytes)
        except ValueError as exc:
            raise InvalidInput(f"KV planes do not add up to the registered layout: {exc}") from None
        old, _ = self._planes.pop(engine_id, ([], fmt))
        for tensor in old:
            device.close(tensor)
        self._planes[engine_id] = (planes, fmt)
        return len(planes)

    def drop(self, engine_id: int) -> None:
        planes, _ = self._planes.pop(engine_id, ([], None))
        for tensor in planes:
            self.transfer.device.close(tensor)

    def _registered(self, engine_id: int) -> tuple[list[torch.Tensor], ChunkFormat]:
        found = self._planes.get(engine_id)
        if found is None:
            raise NotFound(f"engine {engine_id} registered no KV cache (REGISTER_KV_CACHE first)")
        return found

    def _cut(self, offset: int, size: int, fmt: ChunkFormat) -> list[torch.Tensor]:
        """The chunk's bytes in the arena, as one [block, block bytes] view per plane."""
        region = self.engine.arena.tensor(offset, size)
        return [region[pos : pos + n].view(fmt.blocks_per_chunk, -1) for pos, n in fmt.spans()]

    async def load(
        self, engine_id: int, request_id: str, *, first_chunk: int, num_chunks: int, block_ids: Sequence[int],
        skip_blocks: int = 0,
    ) -> bool:  # fmt: skip
        planes, fmt = self._registered(engine_id)
        bpc = fmt.blocks_per_chunk
        if len(block_ids) < (first_chunk + num_chunks) * bpc:
            raise InvalidInput(f"{len(block_ids)} block ids for chunks up to {first_chunk + num_chunks}")
        self._check_blocks(block_ids, planes)
        extents = self.engine.retrieve(engine_id, request_id, first_chunk, num_chunks)
        cuts = [self._cut(ext.offset, ext.size, fmt) for ext in extents]
        chunks = range(first_chunk, first_chunk + len(extents))
        pairs = [
            (plane[block], src[j])
            for i, j, block in fmt.block_pairs(chunks, block_ids, skip_blocks=skip_blocks)
            for plane, src in zip(planes, cuts[i], strict=True)
        ]
        oids = [ext.oid for ext in extents]
        try:
            await self.transfer.run(pairs)
        except Exception as exc:
            self.engine.release(engine_id, request_id, oids)
            raise TransferError(f"copy into the engine's blocks failed: {exc}") from None
        return self.engine.release(engine_id, request_id, oids)

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
        planes, fmt = self._registered(engine_id)
        bpc = fmt.blocks_per_chunk
        self._check_blocks(block_ids, planes)
        slots = self.engine.store(engine_id, request_id, tokens, salt, first_chunk)
        reserved = [s for s in slots if s.status is SlotStatus.RESERVED]
        if len(block_ids) < len(slots) * bpc:
            self.engine.abort(engine_id, [s.oid for s in reserved])
            raise InvalidInput(f"{len(block_ids)} block ids for {len(slots)} chunks of {bpc} blocks")
        cuts = [self._cut(s.offset, s.size, fmt) for s in reserved]
        chunks = [s.chunk - first_chunk for s in reserved]
        pairs = [
            (dst[j], plane[block])
            for i, j, block in fmt.block_pairs(chunks, block_ids)
            for plane, dst in zip(planes, cuts[i], strict=True)
        ]
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
