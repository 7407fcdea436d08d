"""Drives vLLM's own v1 Scheduler, with KVDepotConnector on both sides, against a real sidecar, in
one process and without a model: the "forward" writes each computed token's KV as a function of
(token id, position) and samples a token from the request's last tokens. The engine loop is
vLLM's: schedule -> worker connector (bind, start_load_kv, wait_for_save, get_finished, load
errors, clear) -> update_from_output with the KVConnectorOutput, also in steps where nothing is
scheduled (as `kv_connector_no_forward` does). Run by tests/e2e/test_decode_scheduler.py with
the vLLM interpreter:

    .venv-vllm/bin/python tests/e2e/drive_scheduler.py MODEL_DIR SIDECAR_URL SCENARIO

It prints one JSON object of what it observed. Scenarios: "chat" (two turns, then an abort),
"preempt" (a request preempted mid-answer).
"""

from __future__ import annotations

import json
import socket
import sys
import uuid
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvdepot_connector.vllm.connector import KVDepotConnector

BLOCK, CHUNK, NUM_BLOCKS = 16, 32, 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Engine:
    def __init__(self, model: str, url: str) -> None:
        self.config = VllmConfig(
            model_config=ModelConfig(
                model=model, dtype="bfloat16", max_model_len=2048, skip_tokenizer_init=True
            ),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
            scheduler_config=SchedulerConfig(
                max_num_seqs=8, max_num_batched_tokens=128, max_model_len=2048, is_encoder_decoder=False
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVDepotConnector", kv_connector_module_path="kvdepot_connector.vllm",
                kv_role="kv_both",
                kv_connector_extra_config={
                    "kvdepot_url": url, "kvdepot_chunk_size": CHUNK, "kvdepot_load": "sync",
                },
            ),
            device_config=DeviceConfig("cpu"),
        )  # fmt: skip
        mc, pc = self.config.model_config, self.config.parallel_config
        self.layers = [f"model.layers.{i}.self_attn.attn" for i in range(mc.get_num_layers(pc))]
        self.heads, self.head_dim = mc.get_num_kv_heads(pc), mc.get_head_size()
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=self.heads, head_size=self.head_dim,
                                 dtype=torch.bfloat16)  # fmt: skip
        self.kv_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(self.layers, spec)]
        )
        self.config.cache_config.num_gpu_blocks = NUM_BLOCKS
        with set_current_vllm_config(self.config):
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            )  # fmt: skip
            ensure_model_parallel_initialized(1, 1)
            self.scheduler = Scheduler(
                vllm_config=self.config, kv_cache_config=self.kv_config, log_stats=True,
                structured_output_manager=StructuredOutputManager(self.config), block_size=BLOCK,
            )  # fmt: skip
            self.worker = KVDepotConnector(self.config, KVConnectorRole.WORKER, self.kv_config)
        # The CPU layout: [blocks, kv heads, block size, 2 * head dim] per layer.
        self.kv = {n: torch.zeros(NUM_BLOCKS, self.heads, BLOCK, 2 * self.head_dim, dtype=torch.bfloat16)
                   for n in self.layers}  # fmt: skip
        self.worker.register_kv_caches(self.kv)
        self.log: list[dict[str, Any]] = []
        self.invalid_blocks = 0  # blocks whose load failed (reported to vLLM, recomputed)
        self.salt = uuid.uuid4().hex  # every run its own tenant: a reused sidecar holds nothing of it
        self.free_at_start = self.free_blocks()

    def free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        params.update_from_generation_config({}, None)
        req = Request(rid, prompt, params, None, cache_salt=self.salt)
        self.scheduler.add_request(req)
        return req

    @staticmethod
    def kv_value(token: int, position: int) -> float:
        return float((token * 7 + position) % 251)

    def forward(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Write the KV of every scheduled token; sample for requests whose prompt is done."""
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            start = req.num_computed_tokens - n  # the scheduler already advanced it
            blocks = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
            for pos in range(start, start + n):
                value = self.kv_value(req.all_token_ids[pos], pos)
                for layer in self.kv.values():
                    layer[blocks[pos // BLOCK], :, pos % BLOCK, :] = value
            req_ids.append(rid)
            done = start + n >= req.num_tokens
            sampled.append([100 + sum(req.all_token_ids[-3:]) * 31 % 5000] if done else [])
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
        )

    def step(self) -> dict[str, Any]:
        so = self.scheduler.schedule()
        w = self.worker
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.start_load_kv(None)  # type: ignore[arg-type]
        out = (
            self.forward(so)
            if so.total_num_scheduled_tokens
            else ModelRunnerOutput(req_ids=[], req_id_to_index={})
        )
        w.wait_for_save()
        sending, recving = w.get_finished(so.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        self.invalid_blocks += len(invalid)
        out.kv_connector_output = KVConnectorOutput(
            finished_sending=sending, finished_recving=recving, invalid_block_ids=invalid
        )
        w.clear_connector_metadata()
        self.scheduler.update_from_output(so, out)
        entry = {
            "scheduled": dict(so.num_scheduled_tokens), "finished_req_ids": sorted(so.finished_req_ids),
            "finished_sending": sorted(sending or ()), "held": sorted(self.held()),
        }  # fmt: skip
        self.log.append(entry)
        return entry

    def until_scheduled(self, rid: str) -> dict[str, Any]:
        """Step until `rid` is scheduled (its lookup may wait for chunks coming from L2)."""
        for _ in range(100):
            entry = self.step()
            if rid in entry["scheduled"]:
                return entry
        raise RuntimeError(f"{rid} never scheduled")

    def held(self) -> set[str]:
        """Finished requests whose blocks vLLM still keeps (delayed freeing)."""
        s = self.scheduler
        return {rid for rid, r in s.requests.items() if r.is_finished()}

    def notable(self) -> list[dict[str, Any]]:
        """The steps that finish, hold or report something, or schedule nothing."""
        return [
            s
            for s in self.log
            if s["finished_req_ids"] or s["finished_sending"] or s["held"] or not s["scheduled"]
        ]

    def run(self, limit: int = 200) -> None:
        for _ in range(limit):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise RuntimeError("the engine never went idle: " + json.dumps(self.log[-3:]))

    def kv_ok(self, req: Request, upto: int) -> bool:
        """The request's blocks hold the KV of its tokens [0, upto)."""
        blocks = self.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0]
        return all(
            float(self.kv[self.layers[0]][blocks[p // BLOCK], 0, p % BLOCK, 0])
            == self.kv_value(req.all_token_ids[p], p)
            for p in range(upto)
        )


def chat(e: Engine) -> dict[str, Any]:
    got: dict[str, Any] = {}
    prompt1 = [1000 + i for i in range(3 * CHUNK + 4)]  # 100 tokens: 3 full chunks
    t1 = e.add("t1", prompt1, max_tokens=40)
    e.run()
    got["turn1_output"] = len(t1.output_token_ids)
    got["turn1_steps"] = e.notable()
    got["free_blocks_back"] = e.free_blocks() == e.free_at_start
    # Turn 2: prompt 1 + answer 1 + 20 new tokens. 139 tokens of turn 1 have KV: 4 full chunks.
    prompt2 = list(t1.all_token_ids) + [3000 + i for i in range(20)]
    e.log.clear()
    t2 = e.add("t2", prompt2, max_tokens=8)
    first = e.until_scheduled("t2")
    got["turn2_hit"] = t2.num_computed_tokens - first["scheduled"]["t2"]
    got["turn2_kv_ok"] = e.kv_ok(t2, len(prompt2))
    e.run()
    got["turn2_steps"] = e.notable()
    # An abort mid-answer: blocks freed at once, nothing held, nothing saved.
    e.log.clear()
    a = e.add("a", [5000 + i for i in range(2 * CHUNK + 1)], max_tokens=200)
    for _ in range(40):
        e.step()
    e.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    got["abort_held_after_finish"] = sorted(e.held())
    got["abort_output"] = len(a.output_token_ids)
    e.run()
    got["abort_steps"] = e.notable()
    got["free_blocks_back_at_end"] = e.free_blocks() == e.free_at_start
    got["invalid_blocks"] = e.invalid_blocks
    return got


def preempt(e: Engine) -> dict[str, Any]:
    got: dict[str, Any] = {}
    prompt = [2000 + i for i in range(2 * CHUNK + 10)]
    e.add("first", prompt, max_tokens=1)
    e.run()  # stores the 2 prompt chunks
    r = e.add("r", prompt, max_tokens=60)
    e.log.clear()
    first_step = e.until_scheduled("r")
    got["hit_before"] = r.num_computed_tokens - first_step["scheduled"]["r"]
    for _ in range(19):  # decodes 19 more tokens
        e.step()
    e.scheduler.reset_prefix_cache(reset_running_requests=True)  # vLLM preempts every running request
    got["preemptions"] = r.num_preemptions
    e.log.clear()
    resumed = e.until_scheduled("r")  # looked up again: a hit of the 2 prompt chunks, the rest computed
    got["resumed_hit"] = r.num_computed_tokens - resumed["scheduled"]["r"]
    got["resumed_kv_ok"] = e.kv_ok(r, r.num_computed_tokens)
    e.run()
    got["output"] = len(r.output_token_ids)
    got["steps"] = e.notable()
    got["invalid_blocks"] = e.invalid_blocks
    got["free_blocks_back"] = e.free_blocks() == e.free_at_start
    return got


def main() -> None:
    model, url, scenario = sys.argv[1:4]
    e = Engine(model, url)
    result = {"chat": chat, "preempt": preempt}[scenario](e)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
