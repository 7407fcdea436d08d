"""KVTransfers: the sidecar copies between an engine's paged KV blocks and L1 itself.

Used where the engine can share its KV cache with the sidecar (CUDA IPC handles on a GPU; a sealed
memfd region with the CPU stub): the engine then sends block ids instead of copying.

State: per registered engine, its KV planes opened by the device (one per layer, or per K/V plane
where they are separate), each viewed as [blocks, block bytes], and their chunk format
(`kvdepot_connector.layout.ChunkFormat`: which block of which plane is where in a chunk). Owned
by the event loop. Every call is bounded (`TransferLimits`: planes per registration, block ids,
chunks and copies per call; refusals are InvalidInput) and costs the loop O(chunks): the loop
checks, reserves or locks, and hands a compact plan (per chunk: its arena offset, its engine
block ids, the first block to copy) to the transfer executor, which expands it into copies a
bounded batch at a time (gpu.TransferEngine.run_lazy), merging runs of consecutive blocks.

Engine ids are per engine instance (engine/registry.py), so two engines of one model never share
planes; `drop` lets the planes of a registration the registry dropped go. Planes are opened among
the memory of the registering instance alone (the device looks sealed regions up by that instance
and name, gpu/sealed.py), and the planes registered in a sealed region must cover it (a region is
no larger than the layout needs).

Primitives in call order:
  register(engine, handles)                     open, check against the engine's layout
  load(engine, request, first, n, blocks, skip) retrieve the request's locked chunks, copy them
                                                into the blocks, release -> False if a lease expired
  save(engine, request, tokens, salt, first, blocks[, prompt_tokens, lora_name])
                                                reserve, copy out of the blocks, commit
  drop(engine)                                  the planes are closed
L1 memory stays locked (load) or reserved (save) until its copy has completed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from app.errors import InvalidInput, NotFound, TransferError
from engine.facade import CacheEngine
from engine.results import SlotStatus
from engine.transfer_limits import TransferLimits
from gpu.device import HandleError
from gpu.sealed import SealedRegions, SealError
from gpu.transfer import CopyPair, TransferEngine
from kvdepot_connector.layout import ChunkFormat, blocks_per_chunk
from kvdepot_connector.protocol import TOKEN_BYTES


@dataclass(frozen=True, slots=True)
class SaveOutcome:
    stored: int
    existing: int
    refused: int


@dataclass(frozen=True, slots=True)
class _Plan:
    """One call's copies, compactly: per chunk its arena offset, its engine blocks, and the first
    of them to copy; expanded into copies only in the transfer executor."""

    arena: torch.Tensor
    planes: list[torch.Tensor]
    fmt: ChunkFormat
    chunks: list[tuple[int, Sequence[int], int]]  # (arena offset, block ids of the chunk, first j)
    to_arena: bool

    def copies(self) -> Iterator[CopyPair]:
        bpc, spans = self.fmt.blocks_per_chunk, self.fmt.spans()
        for offset, ids, start in self.chunks:
            for plane, (pos, n) in zip(self.planes, spans, strict=True):
                rows = self.arena[offset + pos : offset + pos + n].view(bpc, -1)
                j = start
                while j < bpc:
                    k = j + 1
                    while k < bpc and ids[k] == ids[k - 1] + 1:
                        k += 1
                    engine_rows = plane[ids[j] : ids[j] + k - j]
                    yield (rows[j:k], engine_rows) if self.to_arena else (engine_rows, rows[j:k])
                    j = k


class KVTransfers:
    def __init__(
        self, engine: CacheEngine, transfer: TransferEngine, limits: TransferLimits | None = None,
        regions: SealedRegions | None = None,
    ) -> None:  # fmt: skip
        self.engine = engine
        self.transfer = transfer
        self.limits = limits or TransferLimits()
        #: the sealed regions the device opens planes in (their coverage is checked at register)
        self.regions = regions
        self._planes: dict[int, tuple[list[torch.Tensor], ChunkFormat]] = {}

    def register(self, engine_id: int, handles: Sequence[dict[str, Any]]) -> int:
        reg = self.engine.registration(engine_id)
        if len(handles) > self.limits.max_planes:
            raise InvalidInput(
                f"{len(handles)} KV planes exceed transfers.max_planes={self.limits.max_planes}"
            )
        device = self.transfer.device
        planes: list[torch.Tensor] = []
        spans: dict[str, list[tuple[int, int]]] = {}  # sealed region -> the planes' byte spans
        try:
            for handle in handles:
                tensor = device.open(handle, reg.instance)
                planes.append(tensor)
                if not tensor.is_contiguous():
                    raise InvalidInput("every KV plane must be contiguous")
                planes[-1] = tensor.view(torch.uint8).view(tensor.shape[0], -1)
                if handle.get("kind") == "cpu-memfd":
                    start = int(handle.get("offset", 0)) * tensor.element_size()
                    spans.setdefault(str(handle["name"]), []).append((start, start + planes[-1].numel()))
        except (HandleError, InvalidInput) as exc:
            for tensor in planes:
                device.close(tensor)
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
        self._check_covered(reg.instance, spans)
        old, _ = self._planes.pop(engine_id, ([], fmt))
        for tensor in old:
            device.close(tensor)
        self._planes[engine_id] = (planes, fmt)
        return len(planes)

    def _check_covered(self, instance: str, spans: dict[str, list[tuple[int, int]]]) -> None:
        """InvalidInput unless the planes registered in each sealed region cover it."""
        if self.regions is None:
            return
        try:
            for name, used in spans.items():
                self.regions.check_covered(instance, name, used)
        except SealError as exc:
            raise InvalidInput(str(exc)) from None

    def drop(self, engine_id: int) -> None:
        planes, _ = self._planes.pop(engine_id, ([], None))
        for tensor in planes:
            self.transfer.device.close(tensor)

    def _registered(self, engine_id: int) -> tuple[list[torch.Tensor], ChunkFormat]:
        found = self._planes.get(engine_id)
        if found is None:
            raise NotFound(f"engine {engine_id} registered no KV cache (REGISTER_KV_CACHE first)")
        return found

    async def load(
        self, engine_id: int, request_id: str, *, first_chunk: int, num_chunks: int, block_ids: Sequence[int],
        skip_blocks: int = 0,
    ) -> bool:  # fmt: skip
        planes, fmt = self._registered(engine_id)
        bpc = fmt.blocks_per_chunk
        self._check_call(len(planes), bpc, num_chunks, block_ids)
        if len(block_ids) < (first_chunk + num_chunks) * bpc:
            raise InvalidInput(f"{len(block_ids)} block ids for chunks up to {first_chunk + num_chunks}")
        self._check_blocks(block_ids, planes)
        extents = self.engine.retrieve(engine_id, request_id, first_chunk, num_chunks)
        chunks = []
        for i, ext in enumerate(extents):
            base = (first_chunk + i) * bpc
            chunks.append((ext.offset, block_ids[base : base + bpc], max(0, skip_blocks - base)))
        plan = _Plan(self.engine.arena.tensor_all, planes, fmt, chunks, to_arena=False)
        oids = [ext.oid for ext in extents]
        try:
            await self.transfer.run_lazy(plan.copies)
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
        extras: Sequence[bytes] = (),
        prompt_tokens: int = 0,
        lora_name: str = "",
    ) -> SaveOutcome:
        planes, fmt = self._registered(engine_id)
        bpc = fmt.blocks_per_chunk
        chunk_tokens = self.engine.registration(engine_id).layout.chunk_size
        self._check_call(
            len(planes), bpc, len(tokens) // TOKEN_BYTES // chunk_tokens - first_chunk, block_ids
        )
        self._check_blocks(block_ids, planes)
        slots = self.engine.store(
            engine_id, request_id, tokens, salt, first_chunk, extras=extras, prompt_tokens=prompt_tokens,
            lora_name=lora_name,
        )  # fmt: skip
        reserved = [s for s in slots if s.status is SlotStatus.RESERVED]
        if len(block_ids) < len(slots) * bpc:
            self.engine.abort(engine_id, [s.oid for s in reserved])
            raise InvalidInput(f"{len(block_ids)} block ids for {len(slots)} chunks of {bpc} blocks")
        chunks = []
        for s in reserved:
            base = (s.chunk - first_chunk) * bpc
            chunks.append((s.offset, block_ids[base : base + bpc], 0))
        plan = _Plan(self.engine.arena.tensor_all, planes, fmt, chunks, to_arena=True)
        try:
            await self.transfer.run_lazy(plan.copies)
        except Exception as exc:
            self.engine.abort(engine_id, [s.oid for s in reserved])
            raise TransferError(f"copy out of the engine's blocks failed: {exc}") from None
        committed = self.engine.commit(engine_id, [s.oid for s in reserved])
        existing = sum(1 for s in slots if s.status is SlotStatus.EXISTS)
        stored = sum(committed)
        return SaveOutcome(stored=stored, existing=existing, refused=len(slots) - existing - stored)

    def _check_call(self, planes: int, bpc: int, chunks: int, block_ids: Sequence[int]) -> None:
        """Refuse a call past the limits before any work: the loop's cost stays O(chunks)."""
        lim = self.limits
        if len(block_ids) > lim.max_blocks_per_call:
            raise InvalidInput(
                f"{len(block_ids)} block ids exceed transfers.max_blocks_per_call={lim.max_blocks_per_call}"
            )
        if chunks > lim.max_chunks_per_call:
            raise InvalidInput(
                f"{chunks} chunks exceed transfers.max_chunks_per_call={lim.max_chunks_per_call}"
            )
        if max(0, chunks) * bpc * planes > lim.max_copies_per_call:
            raise InvalidInput(
                f"{chunks} chunks of {bpc} blocks in {planes} planes exceed "
                f"transfers.max_copies_per_call={lim.max_copies_per_call} block copies"
            )

    @staticmethod
    def _check_blocks(block_ids: Sequence[int], planes: list[torch.Tensor]) -> None:
        limit = planes[0].shape[0]
        if any(b < 0 or b >= limit for b in block_ids):
            raise InvalidInput(f"block ids must be in 0..{limit - 1}")
