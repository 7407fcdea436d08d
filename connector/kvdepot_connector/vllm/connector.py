"""KVDepotConnector: vLLM's KVConnectorBase_V1 on top of the kvdepot sidecar.

A thin shell: it reads vLLM's config, builds the scheduler-side or worker-side logic
(`scheduler.SchedulerSide`, `worker.WorkerSide`) and translates vLLM's objects for them. vLLM
imports this module in its API server, engine core and worker processes; it connects to the
sidecar lazily, so importing it costs nothing and a sidecar that is not there yet is only a miss.

Settings (`kv_connector_extra_config`):
  kvdepot_url          the sidecar's data-plane URL (required), e.g. ipc:///data/dataplane.sock
  kvdepot_chunk_size   tokens per cached chunk, a multiple of vLLM's block size (default 256);
                       must equal the sidecar's l1.chunk_size
  kvdepot_load         "auto" (default): "sync" unless the hit covers the whole prompt, then
                       "async"; "sync": loaded in the step that schedules the request, before
                       its forward, which runs in that step (at least one chunk is computed);
                       "async": vLLM parks the request until the load is reported done and runs
                       it in a later step (the whole prompt may hit; vLLM recomputes the last
                       token). Under concurrent load an engine step lasts as long as the batch's
                       prefill, so each step a hit waits costs that long.
  kvdepot_timeout_s    per data-plane call (default 2.0); a sidecar that does not answer in time
                       is skipped (misses) with a warning and retried with backoff
  kvdepot_model_id     the model name used in cache keys (default: the served model name); set it
                       when engines that share an L2 load the same model from different paths
  kvdepot_transfer     who copies between the KV blocks and L1: "connector" (the worker, through
                       the mapped arena), "sidecar" (CUDA IPC handles; the sidecar copies on its
                       own streams), or "auto" (default: sidecar for CUDA caches, else connector)
  kvdepot_save_decode  true (default) or false: when a request ends, also save the full chunks
                       of its generated tokens (a chat's next turn re-sends the answer as prompt)
  kvdepot_trace_dir    a directory: write a per-request timeline of the connector's work there
                       (`trace.py`; off by default)

Saves: full prompt chunks in the step that computes them (`wait_for_save`); with
kvdepot_save_decode, when a request finishes normally, the full chunks of prompt + generated
tokens not stored yet, in the next step: `request_finished` returns True, vLLM keeps the blocks,
and the workers report the request in `get_finished` (finished_sending) once that save is done.

Keys: a chunk's key covers, besides the model, layout, kv rank, cache_salt and token ids, the
request's LoRA adapter (name and a fingerprint of its files), its multimodal items and its prompt
embeddings (`extra_keys`); a request whose inputs cannot be keyed is not cached.

Ownership: the scheduler and the workers of one engine say HELLO with the same instance nonce, so
the workers may read and release what the scheduler locked and nobody else may. The scheduler
draws it at random when it starts (`identity.new_instance_nonce`; nothing vLLM logs or configures
derives it, so engines given the same `engine_id` still own their requests apart) and hands it to
the workers in every step's metadata (`StepPlan.instance`); a worker connects at engine start
under a private nonce and joins the scheduler's at its first step (`WorkerSide.follow`).

A load that fails is reported to vLLM as failed blocks, which vLLM recomputes: the connector sets
the failure policy to "recompute" (a cache must never fail a request), and `requires_kv_delivery`
is False (a dropped save is a future miss, nothing more).
"""

from __future__ import annotations

import logging
import re
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvdepot_connector.client import KVDepotClient
from kvdepot_connector.handles import export_tensor
from kvdepot_connector.layout import (
    KIND_VLLM_CPU,
    KIND_VLLM_PAGED,
    ChunkFormat,
    blocks_per_chunk,
    canonical_dtype,
)
from kvdepot_connector.protocol import Layout
from kvdepot_connector.tracecontext import traceparent_of
from kvdepot_connector.vllm.extra_keys import AdapterFingerprints, request_keys
from kvdepot_connector.vllm.guard import SidecarGuard
from kvdepot_connector.vllm.identity import new_instance_nonce
from kvdepot_connector.vllm.plan import StepPlan
from kvdepot_connector.vllm.scheduler import CLIENT_ERRORS, LOAD_MODES, ScheduledRequest, SchedulerSide
from kvdepot_connector.vllm.trace import Trace
from kvdepot_connector.vllm.worker import WorkerSide, kv_planes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvdepot.connector")


class KVDepotConnectorMetadata(KVConnectorMetadata):
    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def _layout(vllm_config: VllmConfig, chunk_size: int) -> Layout:
    from vllm.platforms import current_platform

    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if cc.cache_dtype == "auto":
        dtype = canonical_dtype(str(mc.dtype))
    else:
        try:
            dtype = canonical_dtype(str(cc.cache_dtype))
        except ValueError:
            dtype = "uint8"  # a quantized cache of vLLM's own format: kept as bytes
    kind = KIND_VLLM_CPU if current_platform.is_cpu() else KIND_VLLM_PAGED
    return Layout(
        dtype=dtype, num_layers=mc.get_num_layers(pc), num_kv_heads=mc.get_num_kv_heads(pc),
        head_dim=mc.get_head_size(), block_size=cc.block_size, kind=kind, chunk_size=chunk_size,
    )  # fmt: skip


def _layer_index(name: str) -> int:
    found = re.search(r"\.(\d+)\.", name)
    return int(found.group(1)) if found else 0


class KVDepotConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        url = ktc.get_from_extra_config("kvdepot_url", None)
        if not url:
            raise ValueError(
                "KVDepotConnector needs kv_connector_extra_config.kvdepot_url (the sidecar's URL)"
            )
        self._url = str(url)
        block_size = vllm_config.cache_config.block_size
        self._chunk_size = int(ktc.get_from_extra_config("kvdepot_chunk_size", 256))
        if self._chunk_size <= 0 or self._chunk_size % block_size:
            raise ValueError(
                f"kvdepot_chunk_size {self._chunk_size} must be a positive multiple of vLLM's block size "
                f"{block_size} (set --block-size or kvdepot_chunk_size)"
            )
        self._load = str(ktc.get_from_extra_config("kvdepot_load", "auto"))
        if self._load not in LOAD_MODES:
            raise ValueError(f"kvdepot_load must be one of {', '.join(LOAD_MODES)}, not {self._load!r}")
        self._timeout_s = float(ktc.get_from_extra_config("kvdepot_timeout_s", 2.0))
        save_decode = ktc.get_from_extra_config("kvdepot_save_decode", True)
        if not isinstance(save_decode, bool):
            raise ValueError(f"kvdepot_save_decode must be true or false, not {save_decode!r}")
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size > 1:
            raise ValueError("KVDepotConnector does not support pipeline parallelism yet")
        mc = vllm_config.model_config
        served = mc.served_model_name
        default_model = served[0] if isinstance(served, list | tuple) else (served or mc.model)
        self._model = str(ktc.get_from_extra_config("kvdepot_model_id", default_model))
        self._layout = _layout(vllm_config, self._chunk_size)
        # The scheduler's own (its workers learn it from the step metadata); a worker's: none yet.
        self._instance = new_instance_nonce() if role == KVConnectorRole.SCHEDULER else None
        if ktc.kv_load_failure_policy != "recompute":
            log.info(
                "kvdepot: kv_load_failure_policy set to 'recompute' (a cache miss never fails a request)"
            )
            ktc.kv_load_failure_policy = "recompute"
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._blocks: dict[str, list[int]] = {}
        self._adapters = AdapterFingerprints()
        self._trace = Trace(
            "scheduler" if role == KVConnectorRole.SCHEDULER else "worker",
            str(ktc.get_from_extra_config("kvdepot_trace_dir", "") or ""),
        )
        if role == KVConnectorRole.SCHEDULER:
            guard = SidecarGuard()
            clients = [
                KVDepotClient(self._url, model=self._model, layout=self._layout, kv_rank=rank,
                              timeout_s=self._timeout_s, map_arena=False, name=f"vllm-scheduler-{rank}",
                              instance=self._instance, role="scheduler", rank=rank)
                for rank in range(pc.tensor_parallel_size)
            ]  # fmt: skip
            self._scheduler = SchedulerSide(
                clients,
                chunk_size=self._chunk_size,
                block_size=block_size,
                load=self._load,
                guard=guard,
                save_decode=save_decode,
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # --- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        # Token ids as vLLM hashes them: positions given as embeddings hold 0 (their embeddings go
        # into the extra keys).
        started = time.perf_counter()
        prompt = request.all_token_ids[: request.num_prompt_tokens]
        answer = self._scheduler.matched_tokens(
            request.request_id, prompt, request.cache_salt, request.num_tokens, num_computed_tokens,
            keys=lambda: request_keys(request, self._chunk_size, self._adapters),
            preemptions=request.num_preemptions,
            traceparent=traceparent_of(getattr(request, "trace_headers", None)),
        )  # fmt: skip
        self._trace.event("lookup", request.request_id, started, computed=num_computed_tokens, n=answer[0])
        return answer

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request.request_id, blocks.get_block_ids()[0], num_external_tokens)
        self._trace.event("alloc", request.request_id, external=num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        started = time.perf_counter()
        so = scheduler_output
        scheduled: list[ScheduledRequest] = []
        for new in so.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0])
            scheduled.append(ScheduledRequest(new.req_id, self._blocks[new.req_id], new.num_computed_tokens,
                                              so.num_scheduled_tokens.get(new.req_id, 0)))  # fmt: skip
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            added = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self._blocks[rid] = list(added[0]) if added else []
            elif added:
                self._blocks.setdefault(rid, []).extend(added[0])
            scheduled.append(ScheduledRequest(rid, self._blocks.get(rid, []), cached.num_computed_tokens[i],
                                              so.num_scheduled_tokens.get(rid, 0)))  # fmt: skip
        for rid in so.finished_req_ids:
            self._blocks.pop(rid, None)
        plan = self._scheduler.plan_step(scheduled)
        if self._trace.enabled:
            self._trace.event(
                "step", "", started, new=[n.req_id for n in so.scheduled_new_reqs], running=len(scheduled),
                tokens=so.total_num_scheduled_tokens, loads=len(plan.loads),
                saves=sum(s.num_chunks for s in plan.saves),
            )  # fmt: skip
        return KVDepotConnectorMetadata(plan)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.on_output(set(connector_output.invalid_block_ids or ()),
                                  set(getattr(connector_output, "failed_recving", None) or ()))  # fmt: skip

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Delays freeing the blocks (True) while a decode save of the request is due. Only for a
        request that ended by a stop or its length: an aborted one is never saved (the client went
        away or cancelled, so its answer will not come back as a prompt; vLLM also aborts in the
        engine a request whose stop string its frontend matched. And an abort can end a request
        still waiting for an asynchronous load, whose blocks vLLM frees when that load reports
        finished_recving: holding them as well would report, and free, them twice). An error or
        an ignored request has nothing worth keeping either."""
        from vllm.v1.request import RequestStatus

        assert self._scheduler is not None
        self._blocks.pop(request.request_id, None)
        completed = request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
        held = self._scheduler.finished(
            request.request_id, completed=completed, tokens=request.all_token_ids,
            num_computed=request.num_computed_tokens, block_ids=block_ids,
        )  # fmt: skip
        self._trace.event("finished", request.request_id, held=held)
        return held, None

    # --- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        layers = [kv_caches[n] for n in sorted(kv_caches, key=_layer_index)]
        lay = self._layout
        num_blocks = int(self._kv_cache_config.num_blocks)
        planes = [plane for layer in layers for plane in kv_planes(layer, num_blocks)]
        bpc = blocks_per_chunk(lay.chunk_size, lay.block_size)
        fmt = ChunkFormat(tuple(p[0].numel() * p.element_size() for p in planes), bpc)
        if len(layers) != lay.num_layers or fmt.chunk_bytes != lay.chunk_bytes:
            raise ValueError(
                f"KV cache of {len(layers)} layers x {tuple(layers[0].shape)} ({fmt.chunk_bytes} bytes per "
                f"chunk over all layers) does not match the model config ({lay.num_layers} layers, "
                f"{lay.chunk_bytes})"
            )
        transfer = str(self._kv_transfer_config.get_from_extra_config("kvdepot_transfer", "auto"))
        if transfer not in ("auto", "connector", "sidecar"):
            raise ValueError(f"kvdepot_transfer must be auto, connector or sidecar, not {transfer!r}")
        by_sidecar = transfer == "sidecar" or (transfer == "auto" and layers[0].is_cuda)
        rank = get_tensor_model_parallel_rank()
        client = KVDepotClient(
            self._url, model=self._model, layout=lay, kv_rank=rank, timeout_s=self._timeout_s,
            name=f"vllm-worker-{rank}", map_arena=not by_sidecar, instance=None, role="worker",
            rank=rank,
        )  # fmt: skip
        # Connect now, at engine start: mapping the arena (populated, so that copies pay no page
        # faults) takes ~0.5 s per GiB here, which the first save of a request must not wait for.
        # A sidecar that is not up yet is connected to on first use instead.
        try:
            client.connect()
        except CLIENT_ERRORS as exc:
            log.warning("kvdepot: sidecar at %s not reachable at engine start (%s); connecting on first use",
                        self._url, exc)  # fmt: skip
        # CUDA: the sidecar opens the planes through IPC handles and copies on its own streams.
        shared = [export_tensor(p) for p in planes] if by_sidecar else None
        self._worker = WorkerSide(
            client, planes, chunk_size=self._chunk_size, block_size=lay.block_size, shared=shared
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        self._trace.event("step_start")
        if self._worker is not None and isinstance(meta, KVDepotConnectorMetadata):
            self._worker.follow(meta.plan.instance)  # the scheduler's nonce, before any load or save
        if self._worker is not None and isinstance(meta, KVDepotConnectorMetadata) and meta.plan.loads:
            started = time.perf_counter()
            self._worker.load(meta.plan.loads)
            self._trace.event("load", ",".join(s.request_id for s in meta.plan.loads), started,
                              chunks=sum(s.num_chunks for s in meta.plan.loads))  # fmt: skip

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete inside start_load_kv, before any layer runs

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return None  # whole chunks are saved at the end of the step, in wait_for_save

    def wait_for_save(self) -> None:
        # Also in steps without a forward (kv_connector_no_forward): a decode save runs in the step
        # after its request finished, which may be the only work left.
        meta = self._get_connector_metadata()
        plan = meta.plan if isinstance(meta, KVDepotConnectorMetadata) else None
        self._trace.event("step_end")
        if self._worker is not None and plan is not None and (plan.saves or plan.sending):
            started = time.perf_counter()
            self._worker.follow(plan.instance)
            self._worker.save(plan.saves, plan.sending)
            self._trace.event("save", ",".join(s.request_id for s in plan.saves), started,
                              chunks=sum(s.num_chunks for s in plan.saves))  # fmt: skip

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished_sending: requests whose decode save is done, in this step's wait_for_save,
        whose ids are in `finished_req_ids` of the same step; finished_recving: async loads done)."""
        if self._worker is None:
            return None, None
        sent = self._worker.take_sent()
        done = self._worker.take_finished()
        return (sent or None), (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.client.close()
        if self._scheduler is not None:
            for client in self._scheduler.clients:
                client.close()
