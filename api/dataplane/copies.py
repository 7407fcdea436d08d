"""SidecarCopies: the copies the sidecar makes itself between an engine's shared KV cache and L1
(REGISTER_KV_CACHE, LOAD_BLOCKS, SAVE_BLOCKS), for the data-plane server.

The transfers (engine/transfers.py, which needs torch) are given built (where a CUDA device is
configured) or as a factory that the first REGISTER_KV_CACHE awaits, once for all its concurrent
callers, or that `prepare` starts early (an engine shared memory over its lifeline): a sidecar that
no engine asks to copy never imports torch. A making that fails is answered to every caller waiting
(TransferError, retryable), and the next REGISTER_KV_CACHE tries again.

State (event loop only): the transfers once made, the factory, the task making them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from app.errors import InvalidInput, KVDepotError, NotFound, TransferError
from engine.facade import CacheEngine
from kvdepot_connector import protocol as p

if TYPE_CHECKING:
    from engine.transfers import KVTransfers

log = structlog.get_logger("kvdepot.dataplane")


class SidecarCopies:
    def __init__(
        self,
        engine: CacheEngine,
        transfers: KVTransfers | None = None,
        make_transfers: Callable[[], Coroutine[Any, Any, KVTransfers]] | None = None,
    ) -> None:
        self._engine = engine
        self.transfers: KVTransfers | None = None
        self._make_transfers = make_transfers
        self._making: asyncio.Task[KVTransfers] | None = None
        if transfers is not None:
            self._attach(transfers)

    def _attach(self, transfers: KVTransfers) -> None:
        self.transfers = transfers
        self._engine.engines.on_drop.append(transfers.drop)

    def _transfers(self) -> KVTransfers:
        if self.transfers is None:
            if self._make_transfers is None:
                raise InvalidInput("this sidecar does not copy engine KV caches itself")
            # Not made yet: no engine registered a KV cache (a REGISTER_KV_CACHE may be on its way).
            raise NotFound("no engine registered a KV cache (REGISTER_KV_CACHE first)")
        return self.transfers

    def prepare(self) -> None:
        """Start making the copies without waiting for them (an engine shared memory for the
        sidecar to copy into: its REGISTER_KV_CACHE is coming); nothing when made or being made."""
        if self.transfers is None and self._make_transfers is not None and self._making is None:
            self._start_making()

    def _start_making(self) -> asyncio.Task[KVTransfers]:
        assert self._make_transfers is not None
        making = self._making = asyncio.get_running_loop().create_task(self._make_transfers())

        def done(task: asyncio.Task[KVTransfers]) -> None:
            if task.cancelled() or task.exception() is not None:
                if self._making is task:
                    self._making = None  # the next REGISTER_KV_CACHE tries again
                if not task.cancelled():
                    log.error("transfers_unavailable", exc_info=task.exception())
            elif self.transfers is None:
                self._attach(task.result())

        making.add_done_callback(done)
        return making

    async def _made_transfers(self) -> KVTransfers:
        """The transfers, made once for every caller (the others await the same task); a failure
        is answered to every waiting caller, and the next REGISTER_KV_CACHE tries again."""
        making = self._making or self._start_making()
        try:
            return await asyncio.shield(making)
        except KVDepotError:
            raise
        except Exception as exc:
            raise TransferError(f"the sidecar cannot copy KV caches: {type(exc).__name__}: {exc}") from None

    def register(self, m: p.RegisterKVCache) -> p.Reply | Awaitable[p.Reply]:
        handles = [msgspec.structs.asdict(h) for h in m.layers]
        if self.transfers is None and self._make_transfers is not None:
            return self._register_when_made(m.id, m.engine_id, handles)
        return p.CountReply(id=m.id, count=self._transfers().register(m.engine_id, handles))

    async def _register_when_made(self, rid: int, engine_id: int, handles: list[dict[str, Any]]) -> p.Reply:
        transfers = await self._made_transfers()
        return p.CountReply(id=rid, count=transfers.register(engine_id, handles))

    async def load(self, m: p.LoadBlocks) -> p.Reply:
        valid = await self._transfers().load(
            m.engine_id, m.request_id, first_chunk=m.first_chunk, num_chunks=m.num_chunks,
            block_ids=m.block_ids, skip_blocks=m.skip_blocks,
        )  # fmt: skip
        return p.ReleaseReply(id=m.id, valid=valid)

    async def save(self, m: p.SaveBlocks, tokens: bytes) -> p.Reply:
        """`tokens`: the message's tokens, checked by the server."""
        out = await self._transfers().save(
            m.engine_id, m.request_id, tokens=tokens, salt=m.cache_salt,
            first_chunk=m.first_chunk, block_ids=m.block_ids, extras=m.extra_keys,
            prompt_tokens=m.prompt_tokens, lora_name=m.lora_name,
        )  # fmt: skip
        return p.SaveReply(id=m.id, stored=out.stored, existing=out.existing, refused=out.refused)
