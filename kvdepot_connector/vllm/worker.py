"""WorkerSide: the connector's logic in a vLLM worker process, without vLLM imports.

State: the engine's paged KV cache as one uint8 view per layer ([num_blocks, block_bytes]), the
client of this worker's kv rank, requests whose loads finished this step and block ids whose
load failed (reported to vLLM, which then recomputes them). Runs on the worker's thread.

Primitives, in vLLM's step order:
  load(specs)     in start_load_kv: RETRIEVE the request's read-locked chunks, scatter each into
                  its blocks of every layer, RELEASE; an expired lease or any failure reports the
                  request's blocks as failed (never garbage KV)
  save(specs)     in wait_for_save: STORE (reserve), gather each chunk from its blocks into the
                  arena, COMMIT; failures are logged and skipped (a future miss, nothing more)
  take_finished() / take_load_errors()  what get_finished / get_block_ids_with_load_errors report
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvdepot_connector.client import KVDepotClient
from kvdepot_connector.protocol import SlotStatus
from kvdepot_connector.vllm.guard import SidecarGuard
from kvdepot_connector.vllm.plan import LoadSpec, SaveSpec
from kvdepot_connector.vllm.scheduler import CLIENT_ERRORS

log = logging.getLogger("kvdepot.connector")


class WorkerSide:
    def __init__(
        self,
        client: KVDepotClient,
        layers: Sequence[torch.Tensor],
        *,
        chunk_size: int,
        block_size: int,
        guard: SidecarGuard | None = None,
    ) -> None:
        if not layers:
            raise ValueError("no KV cache layers")
        first = layers[0]
        for t in layers:
            if t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous():
                raise ValueError("every KV cache layer must have the same shape and dtype, contiguous")
        self.client = client
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.blocks_per_chunk = chunk_size // block_size
        self.num_blocks = first.shape[0]
        self.block_bytes = first[0].numel() * first.element_size()
        self.chunk_bytes = self.block_bytes * self.blocks_per_chunk * len(layers)
        self.layers = [t.view(torch.uint8).view(self.num_blocks, self.block_bytes) for t in layers]
        self.guard = guard or SidecarGuard()
        self._finished: set[str] = set()
        self._errors: set[int] = set()
        self.loaded_chunks = 0
        self.saved_chunks = 0

    # --- loads ---------------------------------------------------------------------------------

    def load(self, specs: Sequence[LoadSpec]) -> None:
        for spec in specs:
            try:
                ok = self._load_one(spec)
            except CLIENT_ERRORS as exc:
                self.guard.failed("load", exc)
                ok = False
            except Exception:  # a bug here must not kill the engine; recompute instead
                log.exception("kvdepot load of %s failed", spec.request_id)
                ok = False
            if not ok:
                self._errors.update(spec.block_ids[spec.skip_blocks :])
            self._finished.add(spec.request_id)

    def _load_one(self, spec: LoadSpec) -> bool:
        # Always attempted, even while the guard backs off: the scheduler promised vLLM these
        # tokens after a lookup that just succeeded. Only saves (optional work) obey the guard.
        if spec.num_chunks <= 0:
            return False
        views = self.client.locked_views(
            spec.request_id, first_chunk=spec.first_chunk, num_chunks=spec.num_chunks
        )
        bpc = self.blocks_per_chunk
        for i, view in enumerate(views):
            if view.numel() != self.chunk_bytes:
                raise ValueError(f"chunk of {view.numel()} bytes, expected {self.chunk_bytes}")
            chunk = view.view(len(self.layers), bpc, self.block_bytes)
            base = (spec.first_chunk + i) * bpc
            for j in range(bpc):
                if base + j < spec.skip_blocks:
                    continue
                block = spec.block_ids[base + j]
                for layer, src in zip(self.layers, chunk, strict=True):
                    layer[block].copy_(src[j])
        valid = self.client.release(spec.request_id)
        self.guard.succeeded()
        if valid:
            self.loaded_chunks += len(views)
        return valid

    # --- saves ---------------------------------------------------------------------------------

    def save(self, specs: Sequence[SaveSpec]) -> None:
        for spec in specs:
            if not self.guard.available():
                return
            try:
                self._save_one(spec)
            except CLIENT_ERRORS as exc:
                self.guard.failed("save", exc)
            except Exception:
                log.exception("kvdepot save of %s failed", spec.request_id)

    def _save_one(self, spec: SaveSpec) -> None:
        reply = self.client.reserve(
            spec.tokens, request_id=spec.request_id, cache_salt=spec.cache_salt, first_chunk=spec.first_chunk
        )
        bpc = self.blocks_per_chunk
        oids = []
        try:
            for slot in reply.slots:
                if slot.status is not SlotStatus.RESERVED:
                    continue
                base = (slot.chunk - spec.first_chunk) * bpc
                chunk = self.client.slot_view(slot).view(len(self.layers), bpc, self.block_bytes)
                for j in range(bpc):
                    block = spec.block_ids[base + j]
                    for layer, dst in zip(self.layers, chunk, strict=True):
                        dst[j].copy_(layer[block])
                oids.append(slot.oid)
        except BaseException:
            self.client.abort([s.oid for s in reply.slots if s.status is SlotStatus.RESERVED])
            raise
        committed = self.client.commit(oids)
        self.guard.succeeded()
        self.saved_chunks += sum(committed)

    # --- reporting -----------------------------------------------------------------------------

    def take_finished(self) -> set[str]:
        done, self._finished = self._finished, set()
        return done

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors
