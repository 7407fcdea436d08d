"""SchedulerSide: the connector's logic in vLLM's scheduler process, without vLLM imports.

State per request: its prompt tokens (encoded once), its cache_salt, its extra keys (LoRA adapter,
multimodal items, prompt embeddings: `extra_keys`; a request that cannot be keyed is neither
loaded nor stored), the hit found (chunks, read locked in the sidecar for this request on every kv
rank), what is still to be loaded and how many leading chunks are stored already (`saved_chunks`:
saved or loaded by this request, never saved again by it). One client per kv rank (tensor
parallel rank): a hit counts only where every rank has it. Everything here runs on vLLM's
scheduler thread.

Hooks, in the order vLLM calls them:
  matched_tokens(req, computed)   LOOKUP with the request's extra keys, asking for the hits' extents
                                  (an uncacheable request: one LOOKUP saying why, counted, then 0)
                                  (then QUERY_PREFETCH while chunks arrive from L2: None =
                                  "ask me next step"); the answer is cached for repeated asks in
                                  the same step, and in later ones once a load was promised on it
                                  or it covers the whole prompt; otherwise a later step asks again
                                  (chunks saved since by the request that computed them), and so
                                  does a request preempted (its loaded chunks' locks are gone)
  after_alloc(req, blocks, n)     the blocks the hit goes into: a LoadSpec for the next step, with
                                  the lookup's extents (the worker copies without a RETRIEVE)
  plan_step(...)                  loads due + full prompt chunks completed this step -> SaveSpecs,
                                  + the decode saves of requests finished since the last step
  on_output(invalid, failed)      a failed load marks the request: asked again, it answers 0
  finished(req, ...)              END_REQUEST on every rank (locks released), state dropped; a
                                  request that ended normally also saves the full chunks of prompt
                                  + generated tokens not stored yet (the decode save): True = vLLM
                                  keeps its blocks until the workers report it finished_sending

Every SaveSpec is built in one place, `_save_spec`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvdepot_connector.client import KVDepotClient, encode_tokens
from kvdepot_connector.errors import KVDepotClientError
from kvdepot_connector.protocol import TOKEN_BYTES, LookupReply, Uncacheable
from kvdepot_connector.vllm.extra_keys import RequestKeys
from kvdepot_connector.vllm.guard import SidecarGuard
from kvdepot_connector.vllm.plan import LoadSpec, SaveSpec, StepPlan

log = logging.getLogger("kvdepot.connector")

CLIENT_ERRORS = (KVDepotClientError, OSError, ValueError)
# How a hit is loaded. sync: in the step that schedules the request, before its forward (the
# request runs in that same step, like a hit in vLLM's own prefix cache; at least one token is
# computed, so a hit covering the whole prompt loses its last chunk). async: vLLM parks the
# request until the workers report the load done, and schedules it in a later step (the whole
# prompt may hit; vLLM recomputes the last token). auto: sync, unless the hit covers the whole
# prompt. Under load a step takes as long as the batch's prefill, so async costs a step's time.
LOAD_MODES = ("auto", "sync", "async")


@dataclass(slots=True)
class _Request:
    request_id: str
    tokens: bytes
    num_prompt_tokens: int
    salt: str
    keys: RequestKeys | None  # None: uncacheable, never loaded nor stored
    traceparent: str = ""  # the engine's W3C trace context of the request ("" untraced)
    hit_chunks: int = 0
    answered: tuple[int, bool] | None = None
    pending: bool = False
    looked_up: bool = False
    failed: bool = False
    claim: tuple[int, int] | None = None  # tokens [start, end) promised to vLLM, not yet loaded
    claim_async: bool = False  # that load runs asynchronously (vLLM waits for finished_recving)
    load_blocks: tuple[int, ...] = ()
    located: tuple[LookupReply, ...] = ()  # per rank: the lookup's extents, when every rank named them
    asked_step: int = -1  # the step (plan_step count) of the last LOOKUP
    saved_chunks: int = 0
    preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """What vLLM says about one request scheduled this step."""

    request_id: str
    block_ids: Sequence[int]  # the full block table after this step's allocation
    num_computed_tokens: int  # before this step
    num_scheduled_tokens: int


class SchedulerSide:
    def __init__(
        self,
        clients: list[KVDepotClient],
        *,
        chunk_size: int,
        block_size: int,
        load: str = "auto",
        guard: SidecarGuard | None = None,
        save_decode: bool = True,
    ) -> None:
        if chunk_size % block_size:
            raise ValueError(f"chunk size {chunk_size} must be a multiple of the block size {block_size}")
        self.clients = clients
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.blocks_per_chunk = chunk_size // block_size
        if load not in LOAD_MODES:
            raise ValueError(f"load must be one of {', '.join(LOAD_MODES)}, not {load!r}")
        self.load = load
        self.save_decode = save_decode
        self.guard = guard or SidecarGuard()
        self._requests: dict[str, _Request] = {}
        self._loads_due: list[LoadSpec] = []
        self._saves_due: list[SaveSpec] = []
        self._sending: list[str] = []
        self._step = 0  # plan_step calls so far

    # --- lookups -------------------------------------------------------------------------------

    def matched_tokens(
        self, request_id: str, prompt: Sequence[int], salt: str | None, num_tokens: int, num_computed: int,
        *, keys: Callable[[], RequestKeys | Uncacheable] | None = None, preemptions: int = 0,
        traceparent: str = "",
    ) -> tuple[int | None, bool]:  # fmt: skip
        """`keys`: called once, on the request's first ask, for its extra keys (None: plain tokens);
        `traceparent`: the request's W3C trace context, passed on with its lookups."""
        req = self._requests.get(request_id)
        if req is None:
            found = keys() if keys is not None else RequestKeys(self.chunk_size, len(prompt))
            req = _Request(
                request_id, encode_tokens(list(prompt)), len(prompt), salt or "",
                found if isinstance(found, RequestKeys) else None,
            )  # fmt: skip
            req.preemptions = preemptions
            req.traceparent = traceparent
            self._requests[request_id] = req
            if not isinstance(found, RequestKeys):
                self._note_uncacheable(req, found)
        elif req.preemptions != preemptions:
            # Preempted since the last answer: its blocks are gone, and so are the read locks of a
            # hit it loaded (released after the copy). Look up again; what it stored stays stored.
            req.preemptions = preemptions
            req.answered, req.claim, req.pending, req.load_blocks = None, None, False, ()
            req.hit_chunks, req.located = 0, ()
        if req.failed or req.keys is None:
            return 0, False
        if req.answered is not None and not req.pending and not self._stale(req):
            return self._answer(req, num_tokens, num_computed)
        if len(prompt) < self.chunk_size or not self.guard.available():
            req.answered = (0, False)
            return 0, False
        req.looked_up = True
        req.asked_step = self._step
        try:
            replies = []
            for client in self.clients:
                reply = (
                    client.query_prefetch(request_id, extents=True)
                    if req.pending
                    else client.lookup(
                        req.tokens, request_id=request_id, cache_salt=req.salt,
                        extra_keys=req.keys.extras(req.num_prompt_tokens // self.chunk_size),
                        traceparent=req.traceparent, extents=True,
                    )
                )  # fmt: skip
                replies.append(reply)
            hits = [r.hit_chunks for r in replies]
            pending = any(r.pending_chunks > 0 for r in replies)
        except CLIENT_ERRORS as exc:
            self.guard.failed("lookup", exc)
            req.answered = (0, False)
            req.pending = False
            return 0, False
        self.guard.succeeded()
        req.pending = pending
        if pending:
            return None, False  # chunks are arriving from L2: vLLM asks again next step
        req.hit_chunks = min(hits)
        req.located = tuple(replies) if all(len(r.extents) >= req.hit_chunks for r in replies) else ()
        req.answered = (req.hit_chunks, False)
        return self._answer(req, num_tokens, num_computed)

    def _stale(self, req: _Request) -> bool:
        """The answer is from an earlier step, may have grown since (chunks other requests saved
        at the end of a step: a prefix still being computed when this one was first asked), and
        no load was handed to the workers on it (a claim whose blocks were never allocated is
        void): asked again, as vLLM's own cache is at each scheduling try."""
        full = req.num_prompt_tokens // self.chunk_size
        return req.asked_step != self._step and req.hit_chunks < full and not req.load_blocks

    def _note_uncacheable(self, req: _Request, reason: Uncacheable) -> None:
        """Tell the sidecar (one rank is enough: it counts requests) why this one is not cached."""
        log.info("kvdepot: request %s is not cached (%s)", req.request_id, reason.value)
        req.answered = (0, False)
        if not self.clients or not self.guard.available():
            return
        try:
            self.clients[0].lookup(b"", request_id=req.request_id, cache_salt=req.salt, uncacheable=reason)
        except CLIENT_ERRORS as exc:
            self.guard.failed("lookup", exc)

    def _answer(self, req: _Request, num_tokens: int, num_computed: int) -> tuple[int, bool]:
        hit_tokens = req.hit_chunks * self.chunk_size
        asynchronous = self.load == "async" or (self.load == "auto" and hit_tokens >= num_tokens)
        if not asynchronous:
            # A synchronous load must leave at least one token to compute: whole chunks only.
            hit_tokens = min(hit_tokens, (num_tokens - 1) // self.chunk_size * self.chunk_size)
        extra = hit_tokens - num_computed
        if extra <= 0:
            req.claim = None
            return 0, False
        req.claim = (num_computed, hit_tokens)
        req.claim_async = asynchronous
        return extra, asynchronous

    def after_alloc(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """The blocks for the claimed hit exist now: load [claim start, claim end) into them."""
        req = self._requests.get(request_id)
        if req is None or num_external_tokens <= 0 or req.claim is None:
            return
        start, end = req.claim
        first_chunk = start // self.chunk_size
        num_chunks = end // self.chunk_size - first_chunk
        skip_blocks = start // self.block_size
        last_block = (first_chunk + num_chunks) * self.blocks_per_chunk
        if len(block_ids) < last_block:
            # Not enough blocks for what was promised: the worker reports them all as failed, so
            # vLLM recomputes instead of reading blocks nobody wrote.
            log.warning(
                "kvdepot: %s got %d blocks for a hit needing %d", request_id, len(block_ids), last_block
            )
            last_block = len(block_ids)
            num_chunks = 0
        spec = LoadSpec(
            request_id, tuple(block_ids[:last_block]), first_chunk, num_chunks, skip_blocks, req.claim_async,
            req.located, self.clients[0].instance if req.located else "",
        )  # fmt: skip
        req.load_blocks = tuple(block_ids[skip_blocks:last_block])
        req.saved_chunks = max(req.saved_chunks, first_chunk + num_chunks)
        req.claim = None
        self._loads_due.append(spec)

    # --- each step -----------------------------------------------------------------------------

    def plan_step(self, scheduled: Iterable[ScheduledRequest]) -> StepPlan:
        self._step += 1
        plan = StepPlan(
            loads=self._loads_due, saves=self._saves_due, sending=self._sending,
            instance=self.clients[0].instance if self.clients else "",
        )  # fmt: skip
        self._loads_due, self._saves_due, self._sending = [], [], []
        for s in scheduled:
            req = self._requests.get(s.request_id)
            if req is None or req.keys is None:
                continue
            done_tokens = min(s.num_computed_tokens + s.num_scheduled_tokens, req.num_prompt_tokens)
            full = done_tokens // self.chunk_size
            if full <= req.saved_chunks:
                continue
            if len(s.block_ids) < full * self.blocks_per_chunk:
                continue  # never save what the block table does not cover
            plan.saves.append(self._save_spec(req, req.tokens, s.block_ids, full))
        return plan

    def _save_spec(self, req: _Request, tokens: bytes, block_ids: Sequence[int], end_chunk: int) -> SaveSpec:
        """The one place a SaveSpec is built: chunks `req.saved_chunks..end_chunk` of `tokens`
        (uint32 LE, prompt then generated tokens, at least `end_chunk` full chunks) from the
        request's block table; they count as saved from now on."""
        first, bpc = req.saved_chunks, self.blocks_per_chunk
        req.saved_chunks = end_chunk
        return SaveSpec(
            request_id=req.request_id,
            tokens=tokens[: end_chunk * self.chunk_size * TOKEN_BYTES],
            cache_salt=req.salt,
            block_ids=tuple(block_ids[first * bpc : end_chunk * bpc]),
            first_chunk=first,
            num_chunks=end_chunk - first,
            prompt_tokens=req.num_prompt_tokens,
            extra_keys=req.keys.extras(end_chunk) if req.keys is not None else (),
            lora_name=req.keys.lora[0] if req.keys is not None and req.keys.lora is not None else "",
        )

    def on_output(self, invalid_block_ids: set[int], failed_recving: set[str]) -> None:
        """A failed load: that request answers 0 from now on and will recompute (and re-save)."""
        if not invalid_block_ids and not failed_recving:
            return
        for req in self._requests.values():
            if req.request_id in failed_recving or invalid_block_ids.intersection(req.load_blocks):
                if not req.failed:
                    log.warning("kvdepot load failed for %s; it is recomputed", req.request_id)
                req.failed = True
                req.saved_chunks = 0

    def finished(
        self, request_id: str, *, completed: bool = False, tokens: Sequence[int] = (), num_computed: int = 0,
        block_ids: Sequence[int] = (),
    ) -> bool:  # fmt: skip
        """The request is done: its read locks go. `completed`: it ended normally (a stop or its
        length), `tokens` its prompt then generated tokens, `num_computed` how many of them have
        KV in `block_ids` (its block table). Then the full chunks of those not stored yet are
        saved in the next step (the decode save) and True is returned: vLLM must keep the blocks
        until the workers report the request finished_sending (`StepPlan.sending`)."""
        req = self._requests.pop(request_id, None)
        held = False
        if req is not None and completed and self.save_decode:
            held = self._decode_save(req, tokens, num_computed, block_ids)
        if req is None or not req.looked_up or not self.guard.available():
            return held  # never looked up: the sidecar holds nothing for it
        try:
            for client in self.clients:
                client.end_request(request_id)
        except CLIENT_ERRORS as exc:
            self.guard.failed("end_request", exc)
        return held

    def _decode_save(
        self, req: _Request, tokens: Sequence[int], num_computed: int, block_ids: Sequence[int]
    ) -> bool:
        # Whole chunks only, within the tokens that have KV (the last sampled token has none) and
        # the blocks vLLM handed over; chunks saved or loaded before are not saved again.
        end = min(num_computed, len(tokens), len(block_ids) * self.block_size) // self.chunk_size
        if req.keys is None or end <= req.saved_chunks or not self.guard.available():
            return False
        self._saves_due.append(self._save_spec(req, encode_tokens(list(tokens[: end * self.chunk_size])),
                                               block_ids, end))  # fmt: skip
        self._sending.append(req.request_id)
        return True

    def tracked(self) -> int:
        return len(self._requests)
