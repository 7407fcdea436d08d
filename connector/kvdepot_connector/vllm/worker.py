"""WorkerSide: the connector's logic in a vLLM worker process, without vLLM imports.

State: the engine's paged KV cache as uint8 "planes" ([num_blocks, block_bytes]: one per layer,
or one per K and V where a backend keeps them apart), the client of this worker's kv rank,
requests whose loads finished this step and block ids whose load failed (reported to vLLM, which
then recomputes them). Runs on the worker's thread.

Two ways to move the bytes, same chunk format (`kvdepot_connector.layout.ChunkFormat`: the
chunk's blocks of every plane, plane-major):
- the worker copies itself through the mapped L1 arena (CPU engines: their KV is ordinary memory);
- the sidecar copies (`shared` handles given: CUDA IPC, or a shared-memory region): LOAD_BLOCKS /
  SAVE_BLOCKS carry block ids only, and the sidecar runs the copies on its own streams.

Primitives, in vLLM's step order:
  follow(instance) before the step's loads and saves: act for the scheduler's engine instance,
                  whose nonce the step's plan carries (vllm/identity.py)
  load(specs)     in start_load_kv: the request's read-locked chunks into its blocks of every
                  plane (from the extents the scheduler's LOOKUP named, else a RETRIEVE's), then
                  the locks released with the object ids copied from; RELEASE saying
                  valid=False (the objects changed: a lease expired, the scheduler ended the
                  request), or any failure, reports the request's blocks as failed, which vLLM
                  recomputes (never garbage KV)
  save(specs, sending)  in wait_for_save: reserve, fill from the blocks, commit; failures are
                  logged and skipped (a future miss, nothing more); then the finished requests
                  whose blocks vLLM held for these saves (`sending`) are done, saved or not
  take_sent() / take_finished() / take_load_errors()  what get_finished (finished_sending,
                  finished_recving: the asynchronous loads done) and
                  get_block_ids_with_load_errors report
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from kvdepot_connector.client import KVDepotClient
from kvdepot_connector.errors import SidecarError
from kvdepot_connector.layout import ChunkFormat, blocks_per_chunk
from kvdepot_connector.outcomes import Locked
from kvdepot_connector.protocol import ErrorCode, SlotStatus, TensorHandle
from kvdepot_connector.vllm.guard import SidecarGuard
from kvdepot_connector.vllm.plan import LoadSpec, SaveSpec
from kvdepot_connector.vllm.scheduler import CLIENT_ERRORS

log = logging.getLogger("kvdepot.connector")
T = TypeVar("T")


def kv_planes(layer: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """A layer's KV cache as planes indexed by block: [blocks, ...] as is, [2, blocks, ...] split."""
    if layer.shape[0] == num_blocks:
        return [layer]
    if layer.dim() >= 2 and layer.shape[0] == 2 and layer.shape[1] == num_blocks:
        return [layer[0], layer[1]]
    raise ValueError(f"a KV cache of shape {tuple(layer.shape)} is not indexed by its {num_blocks} blocks")


class WorkerSide:
    def __init__(
        self,
        client: KVDepotClient,
        planes: Sequence[torch.Tensor],
        *,
        chunk_size: int,
        block_size: int,
        guard: SidecarGuard | None = None,
        shared: Sequence[TensorHandle] | None = None,
    ) -> None:
        if not planes:
            raise ValueError("no KV cache planes")
        first = planes[0]
        for t in planes:
            if t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous():
                raise ValueError("every KV cache plane must have the same shape and dtype, contiguous")
        self.client = client
        self.chunk_size = chunk_size
        self.block_size = block_size
        num_blocks = first.shape[0]
        block_bytes = first[0].numel() * first.element_size()
        self.format = ChunkFormat((block_bytes,) * len(planes), blocks_per_chunk(chunk_size, block_size))
        self.planes = [t.view(torch.uint8).view(num_blocks, block_bytes) for t in planes]
        self.guard = guard or SidecarGuard()
        self.shared = list(shared) if shared is not None else None
        self._registered_with = 0
        self._finished: set[str] = set()
        self._sent: set[str] = set()
        self._errors: set[int] = set()
        self.loaded_chunks = 0
        self.saved_chunks = 0
        #: loads the scheduler's lookup named but this worker could not copy from (it asked instead)
        self.located_refused = 0

    def _shared_call(self, call: Callable[[], T]) -> T:
        """Run a sidecar-side copy, handing the planes over first when this sidecar (process) has
        not got them: at the first call, and again after it restarted (engine ids change then)."""
        assert self.shared is not None
        if self.client.engine_id == 0 or self.client.engine_id != self._registered_with:
            self.client.register_kv_cache(self.shared)
            self._registered_with = self.client.engine_id
        try:
            return call()
        except SidecarError as exc:
            if exc.code != ErrorCode.NOT_FOUND or self.client.engine_id == self._registered_with:
                raise
        self.client.register_kv_cache(self.shared)  # re-handshaken during the call: register again
        self._registered_with = self.client.engine_id
        return call()

    def follow(self, instance: str) -> None:
        """Act for the engine instance the scheduler named in this step's plan (vllm/identity.py):
        the worker's client joins it before the step's loads and saves (once; a plan naming none
        changes nothing)."""
        if instance and instance != self.client.instance:
            self.client.join_instance(instance)

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
            if spec.asynchronous:
                self._finished.add(spec.request_id)

    def _load_one(self, spec: LoadSpec) -> bool:
        # Always attempted, even while the guard backs off: the scheduler promised vLLM these
        # tokens after a lookup that just succeeded. Only saves (optional work) obey the guard.
        if spec.num_chunks <= 0:
            return False
        if self.shared is not None:
            valid = self._shared_call(
                lambda: self.client.load_blocks(
                    spec.request_id, first_chunk=spec.first_chunk, num_chunks=spec.num_chunks,
                    block_ids=spec.block_ids, skip_blocks=spec.skip_blocks,
                )
            )  # fmt: skip
        else:
            valid = self._copy_in(spec)
        self.guard.succeeded()
        if valid:
            self.loaded_chunks += spec.num_chunks
        return valid

    def _copy_in(self, spec: LoadSpec) -> bool:
        """Copy out of the locked chunks; valid only if every object copied from is still the
        same (the release fences unmoved, or the sidecar's generation check): else the blocks
        are failed."""
        locked = self._located(spec) or self.client.locked(
            spec.request_id, first_chunk=spec.first_chunk, num_chunks=spec.num_chunks
        )
        cuts = [self._cut(view) for view in locked.views]
        chunks = range(spec.first_chunk, spec.first_chunk + len(locked.views))
        try:
            for i, j, block in self.format.block_pairs(chunks, spec.block_ids, skip_blocks=spec.skip_blocks):
                for plane, src in zip(self.planes, cuts[i], strict=True):
                    plane[block].copy_(src[j])
        except BaseException:
            self.client.release(spec.request_id, locked.oids, epoch=locked.epoch)
            raise
        valid = self.client.release(spec.request_id, locked.oids, fences=locked.fences, epoch=locked.epoch)
        return valid and len(locked.views) == spec.num_chunks

    def _located(self, spec: LoadSpec) -> Locked | None:
        """The chunks as the scheduler's LOOKUP named them for this worker's kv rank (no round
        trip), or None: not named, named for another engine instance than the one this worker
        acts for (the RETRIEVE is then refused), or in an arena this client does not map (a
        sidecar restarted since: the RETRIEVE then says HELLO to it first)."""
        rank = self.client.kv_rank
        if rank >= len(spec.located) or spec.instance != self.client.instance:
            return None
        try:
            return self.client.locked_from(spec.located[rank], first_chunk=spec.first_chunk,
                                           num_chunks=spec.num_chunks)  # fmt: skip
        except ValueError:
            self.located_refused += 1
            return None

    def _cut(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        """A chunk's bytes (a uint8 view of the arena) as one [block, block bytes] view per plane."""
        self.format.check(chunk.numel())
        return [chunk[pos : pos + n].view(self.format.blocks_per_chunk, -1) for pos, n in self.format.spans()]

    # --- saves ---------------------------------------------------------------------------------

    def save(self, specs: Sequence[SaveSpec], sending: Sequence[str] = ()) -> None:
        try:
            for spec in specs:
                if not self.guard.available():
                    return
                try:
                    self._save_one(spec)
                except CLIENT_ERRORS as exc:
                    self.guard.failed("save", exc)
                except Exception:
                    log.exception("kvdepot save of %s failed", spec.request_id)
        finally:
            # Saved, skipped or failed: vLLM may free these requests' blocks now.
            self._sent.update(sending)

    def _save_one(self, spec: SaveSpec) -> None:
        if self.shared is not None:
            out = self._shared_call(
                lambda: self.client.save_blocks(
                    spec.tokens, request_id=spec.request_id, block_ids=spec.block_ids,
                    cache_salt=spec.cache_salt, first_chunk=spec.first_chunk, extra_keys=spec.extra_keys,
                    prompt_tokens=spec.prompt_tokens, lora_name=spec.lora_name,
                )
            )  # fmt: skip
            self.guard.succeeded()
            self.saved_chunks += out.stored
            return
        reply = self.client.reserve(
            spec.tokens, request_id=spec.request_id, cache_salt=spec.cache_salt,
            first_chunk=spec.first_chunk, extra_keys=spec.extra_keys, prompt_tokens=spec.prompt_tokens,
            lora_name=spec.lora_name,
        )  # fmt: skip
        reserved = [s for s in reply.slots if s.status is SlotStatus.RESERVED]
        try:
            cuts = [self._cut(self.client.slot_view(slot)) for slot in reserved]
            chunks = [slot.chunk - spec.first_chunk for slot in reserved]
            for i, j, block in self.format.block_pairs(chunks, spec.block_ids):
                for plane, dst in zip(self.planes, cuts[i], strict=True):
                    dst[j].copy_(plane[block])
        except BaseException:
            self.client.abort([s.oid for s in reserved])
            raise
        committed = self.client.commit([s.oid for s in reserved])
        self.guard.succeeded()
        self.saved_chunks += sum(committed)

    # --- reporting -----------------------------------------------------------------------------

    def take_sent(self) -> set[str]:
        sent, self._sent = self._sent, set()
        return sent

    def take_finished(self) -> set[str]:
        done, self._finished = self._finished, set()
        return done

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors
