"""ProbeConnector: a vLLM v1 KV connector that moves no KV and logs every hook call.

An experiment, not part of kvdepot: it shows which hooks vLLM calls, in which process, in which
order and with which arguments. Each call appends one JSON line to the log file (default
`/tmp/probe_connector.jsonl`, or `kv_connector_extra_config["log_path"]`):
`{"t": ..., "pid": ..., "role": "scheduler"|"worker"|"class", "hook": ..., ...summary}`. The log grows by
about 2 lines per layer plus 15 per engine step and is never truncated: use a fresh path per run.

    PYTHONPATH=tests/e2e python -m vllm.entrypoints.openai.api_server ... \
      --kv-transfer-config '{"kv_connector":"ProbeConnector","kv_connector_module_path":"probe_connector",
                             "kv_role":"kv_both","kv_connector_extra_config":{"log_path":"/tmp/p.jsonl"}}'

Behaviour can be steered per request through the completion request's `kv_transfer_params`
(it reaches the scheduler side as `request.kv_transfer_params`):

- `probe_hit_tokens: N`: get_num_new_matched_tokens reports an external hit of N tokens (clipped to
  `num_tokens - 1 - num_computed_tokens`). Nothing is loaded, so the output is garbage.
- `probe_async: true`: that hit is reported as asynchronous; the worker reports the load finished
  on the next get_finished call.
- `probe_delay_free: true`: request_finished returns True (blocks stay allocated); the worker
  reports the request in finished_sending on the next get_finished call that can.
- `probe_fail_load: true`: the worker reports the first block of that (pretended) load in
  get_block_ids_with_load_errors. With `kv_load_failure_policy: "recompute"` vLLM then asks
  get_num_new_matched_tokens again for the same request; the probe answers 0 the second time
  (answering the same hit again would retry the failing load forever).

The worker side also inspects, for each finished request, how the written tokens of its last block
are laid out in the KV tensor (see `_layout_report`).
"""

from __future__ import annotations

import inspect
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

DEFAULT_LOG = "/tmp/probe_connector.jsonl"
_lock = threading.Lock()


def _emit(path: str, role: str, hook: str, **fields: Any) -> None:
    rec = {"t": round(time.time(), 6), "pid": os.getpid(), "role": role, "hook": hook, **fields}
    line = json.dumps(rec, default=repr) + "\n"
    with _lock, open(path, "a", encoding="utf-8") as f:
        f.write(line)


def _tensor(t: Any, values: int = 0) -> Any:
    """A short description of a tensor; with values > 0, its first and last few values too."""
    if not isinstance(t, torch.Tensor):
        return repr(t)[:200]
    d: dict[str, Any] = {
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "device": str(t.device),
    }
    if values and t.numel():
        flat = t.reshape(-1)
        d["head"] = flat[:values].tolist()
        d["tail"] = flat[-values:].tolist()
    return d


def _request(r: Request) -> dict[str, Any]:
    sp = r.sampling_params
    return {
        "type": type(r).__name__,
        "request_id": r.request_id,
        "status": str(r.status),
        "num_prompt_tokens": r.num_prompt_tokens,
        "prompt_token_ids_type": type(r.prompt_token_ids).__name__,
        "prompt_head": list(r.prompt_token_ids[:4]) if r.prompt_token_ids else None,
        "num_tokens": r.num_tokens,
        "num_computed_tokens": r.num_computed_tokens,
        "num_output_tokens": len(r.output_token_ids),
        "cache_salt": r.cache_salt,
        "kv_transfer_params": r.kv_transfer_params,
        "num_block_hashes": len(r.block_hashes),
        "block_hash_type": type(r.block_hashes[0]).__name__ if r.block_hashes else None,
        "lora": None
        if r.lora_request is None
        else {
            "type": type(r.lora_request).__name__,
            "lora_name": r.lora_request.lora_name,
            "lora_int_id": r.lora_request.lora_int_id,
            "lora_path": r.lora_request.lora_path,
            "load_inplace": r.lora_request.load_inplace,
        },
        "mm_features": len(r.mm_features),
        "max_tokens": sp.max_tokens if sp is not None else None,
    }


@dataclass
class ProbeMetadata(KVConnectorMetadata):
    """What the scheduler side hands to the workers each step (pickled across processes)."""

    step: int
    # req_id -> block ids (group 0) of every request scheduled this step, from the scheduler output
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> (block ids, num external tokens, async, fail) of loads decided in update_state_after_alloc
    loads: dict[str, tuple[list[int], int, bool, bool]] = field(default_factory=dict)
    # requests whose blocks the scheduler keeps until the worker reports them in finished_sending
    delayed_free: list[str] = field(default_factory=list)


class ProbeConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._log = str(self._kv_transfer_config.get_from_extra_config("log_path", DEFAULT_LOG))
        self._rolename = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self._step = 0
        # scheduler side
        self._pending_loads: dict[str, tuple[list[int], int, bool, bool]] = {}
        self._pending_delayed: list[str] = []
        self._failed_once: set[str] = set()
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._req_blocks: dict[str, list[int]] = {}
        self._recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._sending: set[str] = set()
        self._layers_seen: list[str] = []

        mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
        tp_rank = None
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        groups = [
            {
                "layer_names": g.layer_names,
                "spec": type(g.kv_cache_spec).__name__,
                "block_size": g.kv_cache_spec.block_size,
                "num_kv_heads": getattr(g.kv_cache_spec, "num_kv_heads", None),
                "head_size": getattr(g.kv_cache_spec, "head_size", None),
                "dtype": str(getattr(g.kv_cache_spec, "dtype", None)),
                "page_size_bytes": g.kv_cache_spec.page_size_bytes,
            }
            for g in kv_cache_config.kv_cache_groups
        ]
        tensors = [
            {
                "size": t.size,
                "layers": len(t.layers),
                "layer_stride": t.layer_stride,
                "block_stride": t.block_stride,
                "offset": t.offset,
            }
            for t in kv_cache_config.kv_cache_tensors
        ]
        self._emit(
            "__init__",
            signature=str(inspect.signature(KVConnectorBase_V1.__init__)),
            role_enum=str(role),
            kv_role=self._kv_transfer_config.kv_role,
            engine_id=self._kv_transfer_config.engine_id,
            extra_config=self._kv_transfer_config.kv_connector_extra_config,
            kv_load_failure_policy=self._kv_transfer_config.kv_load_failure_policy,
            model=mc.model,
            served_model_name=mc.served_model_name,
            dtype=str(mc.dtype),
            cache_dtype=cc.cache_dtype,
            block_size=cc.block_size,
            num_layers=mc.get_num_layers(pc),
            total_num_kv_heads=mc.get_total_num_kv_heads(),
            num_kv_heads_per_rank=mc.get_num_kv_heads(pc),
            head_size=mc.get_head_size(),
            tp_size=pc.tensor_parallel_size,
            pp_size=pc.pipeline_parallel_size,
            parallel_config_rank=pc.rank,
            tp_rank=tp_rank,
            enable_prefix_caching=cc.enable_prefix_caching,
            kv_cache_layout=kv_cache_config.kv_cache_layout,
            num_blocks=kv_cache_config.num_blocks,
            kv_cache_groups=groups,
            kv_cache_tensors=tensors,
            requires_kv_delivery=self.requires_kv_delivery,
        )

    def _emit(self, hook: str, **fields: Any) -> None:
        _emit(self._log, self._rolename, hook, **fields)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        path = vllm_config.kv_transfer_config.get_from_extra_config("log_path", DEFAULT_LOG)
        _emit(path, "class", "get_required_kvcache_layout")
        return None

    # ---------------------------------------------------------------- scheduler side

    def on_new_request(self, request: Request) -> None:
        self._emit("on_new_request", request=_request(request))

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        hit = int(params.get("probe_hit_tokens", 0))
        hit = max(0, min(hit, request.num_tokens - 1 - num_computed_tokens))
        if params.get("probe_fail_load"):
            if request.request_id in self._failed_once:
                hit = 0
            elif hit:
                self._failed_once.add(request.request_id)
        load_async = bool(params.get("probe_async", False)) and hit > 0
        self._emit(
            "get_num_new_matched_tokens",
            request=_request(request),
            num_computed_tokens=num_computed_tokens,
            returns=[hit, load_async],
        )
        return hit, load_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        block_ids = blocks.get_block_ids()
        self._emit(
            "update_state_after_alloc",
            request=_request(request),
            blocks_type=type(blocks).__name__,
            block_ids=block_ids,
            block_ids_type=f"{type(block_ids).__name__}[{type(block_ids[0]).__name__}]",
            num_external_tokens=num_external_tokens,
        )
        if num_external_tokens > 0:
            params = request.kv_transfer_params or {}
            self._pending_loads[request.request_id] = (
                list(block_ids[0]),
                num_external_tokens,
                bool(params.get("probe_async", False)),
                bool(params.get("probe_fail_load", False)),
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._step += 1
        so = scheduler_output
        cached = so.scheduled_cached_reqs
        meta = ProbeMetadata(step=self._step)
        for nr in so.scheduled_new_reqs:
            meta.block_ids[nr.req_id] = list(nr.block_ids[0])
        for i, rid in enumerate(cached.req_ids):
            nb = cached.new_block_ids[i]
            if nb is not None and so.kv_connector_block_state is not None:
                full = so.kv_connector_block_state.get_block_ids(rid)
                if full is not None:
                    meta.block_ids[rid] = list(full[0])
        meta.loads, self._pending_loads = self._pending_loads, {}
        meta.delayed_free, self._pending_delayed = self._pending_delayed, []
        self._emit(
            "build_connector_meta",
            step=self._step,
            scheduled_new_reqs=[
                {
                    "req_id": nr.req_id,
                    "prompt_len": nr.prompt_len,
                    "block_ids": nr.block_ids,
                    "num_computed_tokens": nr.num_computed_tokens,
                }
                for nr in so.scheduled_new_reqs
            ],
            scheduled_cached_reqs={
                "req_ids": cached.req_ids,
                "resumed_req_ids": sorted(cached.resumed_req_ids),
                "new_block_ids": cached.new_block_ids,
                "num_computed_tokens": cached.num_computed_tokens,
                "num_output_tokens": cached.num_output_tokens,
            },
            num_scheduled_tokens=so.num_scheduled_tokens,
            total_num_scheduled_tokens=so.total_num_scheduled_tokens,
            finished_req_ids=sorted(so.finished_req_ids),
            preempted_req_ids=sorted(so.preempted_req_ids or ()),
            has_sync_kv_loads=so.has_sync_kv_loads,
            new_block_ids_to_zero=so.new_block_ids_to_zero,
            block_state_req_ids=(
                sorted(so.kv_connector_block_state.req_ids) if so.kv_connector_block_state else None
            ),
            meta_loads=meta.loads,
            meta_delayed_free=meta.delayed_free,
        )
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        o = connector_output
        self._emit(
            "update_connector_output",
            finished_sending=sorted(o.finished_sending or ()),
            finished_recving=sorted(o.finished_recving or ()),
            failed_recving=sorted(getattr(o, "failed_recving", None) or ()),
            invalid_block_ids=sorted(o.invalid_block_ids or ()),
            worker_meta=repr(getattr(o, "kv_connector_worker_meta", None)),
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        delay = bool(params.get("probe_delay_free", False))
        self._failed_once.discard(request.request_id)
        if delay:
            self._pending_delayed.append(request.request_id)
        self._emit(
            "request_finished",
            request=_request(request),
            block_ids=block_ids,
            block_ids_type=f"{type(block_ids).__name__}[{type(block_ids[0]).__name__ if block_ids else ''}]",
            returns=[delay, None],
        )
        return delay, None

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches
        names = list(kv_caches)
        first = kv_caches[names[0]]
        ptrs = [kv_caches[n].data_ptr() for n in names]
        self._emit(
            "register_kv_caches",
            num_layers=len(names),
            layer_names=names,
            shape=list(first.shape),
            stride=list(first.stride()),
            dtype=str(first.dtype),
            device=str(first.device),
            is_contiguous=first.is_contiguous(),
            nbytes_per_layer=first.numel() * first.element_size(),
            data_ptr_deltas=[p - ptrs[0] for p in ptrs],
            same_storage=len({kv_caches[n].untyped_storage().data_ptr() for n in names}) == 1,
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, ProbeMetadata)
        m = connector_metadata
        self._req_blocks.update(m.block_ids)
        self._recving.update(rid for rid, (_, _, is_async, _) in m.loads.items() if is_async)
        self._load_errors.update(blocks[0] for blocks, _, _, fail in m.loads.values() if fail and blocks)
        self._sending.update(m.delayed_free)
        self._layers_seen = []
        self._emit(
            "bind_connector_metadata",
            meta_type=type(m).__name__,
            step=m.step,
            block_ids=m.block_ids,
            loads=m.loads,
            delayed_free=m.delayed_free,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        am = forward_context.attn_metadata
        self._emit(
            "start_load_kv",
            step=self._meta_step(),
            forward_context_type=type(forward_context).__name__,
            attn_metadata_type=type(am).__name__,
            attn_metadata_keys=list(am)[:2] + (["..."] if len(am) > 2 else [])
            if isinstance(am, dict)
            else None,
            no_compile_layers=len(forward_context.no_compile_layers),
            kwargs=list(kwargs),
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._emit("wait_for_layer_load", step=self._meta_step(), layer_name=layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        first = not self._layers_seen
        self._layers_seen.append(layer_name)
        fields: dict[str, Any] = {
            "step": self._meta_step(),
            "layer_name": layer_name,
            "kv_layer": _tensor(kv_layer),
            "same_tensor_as_registered": kv_layer.data_ptr() == self._kv_caches[layer_name].data_ptr(),
            "kwargs": list(kwargs),
        }
        if first:  # the metadata is the same object for every layer of a step; describe it once
            md: dict[str, Any] = {"type": type(attn_metadata).__name__}
            for k, v in vars(attn_metadata).items():
                md[k] = _tensor(v, values=4) if isinstance(v, torch.Tensor) else repr(v)[:120]
            fields["attn_metadata"] = md
        self._emit("save_kv_layer", **fields)

    def wait_for_save(self) -> None:
        self._emit("wait_for_save", step=self._meta_step(), layers_saved=len(self._layers_seen))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recving, self._recving = self._recving, set()
        sending = {r for r in self._sending if r in finished_req_ids}
        self._sending -= sending
        for rid in sorted(finished_req_ids):
            if rid in self._req_blocks:
                self._emit("layout_report", req_id=rid, **self._layout_report(self._req_blocks.pop(rid)))
        self._emit(
            "get_finished",
            step=self._meta_step(),
            finished_req_ids=sorted(finished_req_ids),
            returns=[sorted(sending) or None, sorted(recving) or None],
        )
        return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        self._emit("get_block_ids_with_load_errors", step=self._meta_step(), returns=sorted(errors))
        return errors

    def shutdown(self) -> None:
        self._emit("shutdown")

    # ---------------------------------------------------------------- helpers

    def _meta_step(self) -> int | None:
        m = self._connector_metadata
        return m.step if isinstance(m, ProbeMetadata) else None

    def _layout_report(self, block_ids: list[int]) -> dict[str, Any]:
        """Which rows/columns of a request's blocks hold data, in layer 0.

        A layer is [num_blocks, kv_heads, block_size, 2*head_size]; per (block, head) the memory is
        2*block_size*head_size elements: the K half then the V half. For each block the report gives
        the number of written token rows if V is [block_size, head_size] (rows with any non-zero),
        and for K both readings: rows of [block_size, head_size] and columns of [head_size, block_size].
        """
        if not self._kv_caches or not block_ids:
            return {}
        layer = next(iter(self._kv_caches.values()))
        _, _, bs, two_d = layer.shape
        d = two_d // 2
        out = []
        for b in block_ids:
            flat = layer[b, 0].reshape(-1)
            k, v = flat[: bs * d], flat[bs * d :]
            v_rows = int((v.view(bs, d) != 0).any(dim=1).sum())
            k_rows_nd = int((k.view(bs, d) != 0).any(dim=1).sum())
            k_cols_dn = int((k.view(d, bs) != 0).any(dim=0).sum())
            out.append({"block": b, "v_rows": v_rows, "k_as_NxD_rows": k_rows_nd, "k_as_DxN_cols": k_cols_dn})
        return {"blocks": out}


# Log every other public hook that ProbeConnector does not override (per-step stats, events,
# worker metadata, lifecycle notifications...), so that the log shows the complete call sequence.
def _wrap(name: str) -> Any:
    base = getattr(KVConnectorBase_V1, name)

    def hook(self: ProbeConnector, *args: Any, **kwargs: Any) -> Any:
        result = base(self, *args, **kwargs)
        self._emit(
            name,
            step=self._meta_step() if self._rolename == "worker" else None,
            args=[type(a).__name__ for a in args],
            kwargs=list(kwargs),
            returns=repr(result)[:200],
        )
        return result

    hook.__name__ = name
    return hook


for _name, _attr in vars(KVConnectorBase_V1).items():
    if (
        not _name.startswith("_")
        and inspect.isfunction(_attr)
        and _name not in vars(ProbeConnector)
        and _name not in {"role", "has_connector_metadata"}
    ):
        setattr(ProbeConnector, _name, _wrap(_name))
