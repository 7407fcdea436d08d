"""Decode saves through the connector's two halves against a real sidecar, without vLLM: a request
that finishes saves the full chunks of its prompt + generated tokens not stored yet, once, holds
its blocks (True) until the worker reports it sent, and the next turn of the chat hits through
them. vLLM's side of the contract (statuses, delayed freeing, steps without a forward) is checked
with vLLM's own scheduler in tests/e2e/test_decode_scheduler.py."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from bench.sidecar import SidecarProcess
from kvdepot_connector.client import KVDepotClient
from kvdepot_connector.handles import export_tensor
from kvdepot_connector.vllm.scheduler import ScheduledRequest, SchedulerSide
from kvdepot_connector.vllm.worker import WorkerSide
from tests.integration.conftest import StartSidecar
from tests.integration.metrics_sidecar import metric
from tests.integration.test_connector_sides import BLOCK, CHUNK, KV, LAYOUT, ask

BPC = CHUNK // BLOCK


@dataclass
class Engine:
    """One engine instance's two connector halves."""

    sc: SidecarProcess
    sched: SchedulerSide
    worker: WorkerSide
    kv: KV

    def prefill(self, rid: str, prompt: list[int], blocks: list[int], computed: int = 0) -> None:
        """One step computing the rest of the prompt: its KV written, its full chunks saved."""
        self.kv.fill(blocks[computed // BLOCK : (len(prompt) + BLOCK - 1) // BLOCK], seed=len(prompt))
        plan = self.sched.plan_step([ScheduledRequest(rid, blocks, computed, len(prompt) - computed)])
        assert plan.sending == []
        self.worker.save(plan.saves, plan.sending)

    def next_step(self) -> tuple[list[tuple[int, int]], set[str]]:
        """A step with nothing scheduled (the finished request was the only one): its saves, as
        (first chunk, chunks), and the requests the worker reports sent."""
        plan = self.sched.plan_step([])
        self.worker.save(plan.saves, plan.sending)
        return [(s.first_chunk, s.num_chunks) for s in plan.saves], self.worker.take_sent()


@pytest.fixture
def engine(sidecar_factory: StartSidecar, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Engine]:
    """Worker copies through the arena; with the parameter True, the sidecar copies (SAVE_BLOCKS)."""
    by_sidecar = bool(getattr(request, "param", False))
    sc = sidecar_factory(
        env={"KVDEPOT_L1__CHUNK_SIZE": str(CHUNK)}, l1_size_gb=0.02, data_dir=tmp_path / "sc"
    )
    instance = secrets.token_hex(16)
    sched_client = KVDepotClient(sc.url, model="m", layout=LAYOUT, map_arena=False, instance=instance)
    work_client = KVDepotClient(
        sc.url, model="m", layout=LAYOUT, instance=instance, timeout_s=10.0, map_arena=not by_sidecar
    )
    kv = KV()
    work_client.connect().share([kv.shared.region()])
    shared = [export_tensor(p, kv.shared) for p in kv.planes()] if by_sidecar else None
    worker = WorkerSide(work_client, kv.planes(), chunk_size=CHUNK, block_size=BLOCK, shared=shared)
    sched = SchedulerSide([sched_client], chunk_size=CHUNK, block_size=BLOCK, load="sync")
    yield Engine(sc, sched, worker, kv)
    sched_client.close()
    work_client.close()
    kv.shared.close()


@pytest.mark.parametrize("engine", [False, True], indirect=True, ids=["worker-copies", "sidecar-copies"])
def test_a_finished_request_saves_its_answer_once_and_the_next_turn_hits_through_it(engine: Engine) -> None:
    e = engine
    prompt = list(range(1000, 1000 + 2 * CHUNK + 5))  # 2 full chunks and 5 tokens
    answer = list(range(5000, 5000 + 40))
    blocks1 = list(range(1, 9))  # 8 blocks of 16: room for prompt + answer (109 tokens)
    assert ask(e.sched, "r1", prompt) == (0, False)
    e.prefill("r1", prompt, blocks1)
    assert e.worker.saved_chunks == 2
    e.kv.fill(blocks1[4:7], seed=99)  # the decode steps write the answer's KV
    # 69 + 40 tokens, the last one sampled has no KV: 108 computed = 3 full chunks, chunk 3 partial.
    held = e.sched.finished(
        "r1", completed=True, tokens=prompt + answer, num_computed=108, block_ids=blocks1[:7]
    )
    assert held, "vLLM must keep the blocks until the save is reported"
    saves, sent = e.next_step()
    assert saves == [(2, 1)], "only the chunk not stored yet; never the partial one"
    assert sent == {"r1"}
    assert e.worker.saved_chunks == 3
    assert metric(e.sc, "kvdepot_decode_chunks_stored_total") == 1
    assert metric(e.sc, "kvdepot_stored_chunks_total") == 3
    assert e.next_step() == ([], set()), "nothing is saved or reported twice"
    written = e.kv.blocks(blocks1[: 3 * BPC])

    # Turn 2: the previous prompt, the answer, new tokens. It hits through the answer's full chunk.
    prompt2 = prompt + answer + list(range(9000, 9030))  # 139 tokens
    assert ask(e.sched, "r2", prompt2) == (3 * CHUNK, False)
    blocks2 = list(range(20, 30))
    e.sched.after_alloc("r2", blocks2, 3 * CHUNK)
    plan = e.sched.plan_step([ScheduledRequest("r2", blocks2, 3 * CHUNK, len(prompt2) - 3 * CHUNK)])
    assert [(s.first_chunk, s.num_chunks) for s in plan.saves] == [(3, 1)]  # loaded chunks are not saved
    e.worker.load(plan.loads)
    assert e.worker.take_load_errors() == set()
    assert all(torch.equal(a, b) for a, b in zip(written, e.kv.blocks(blocks2[: 3 * BPC]), strict=True))
    e.worker.save(plan.saves, plan.sending)
    # 160 tokens, but the last one sampled has no KV: chunk 4 is not full, nothing to save, the
    # blocks are not held.
    tokens2 = prompt2 + list(range(21))
    assert not e.sched.finished("r2", completed=True, tokens=tokens2, num_computed=159, block_ids=blocks2)
    assert e.next_step() == ([], set())
    assert metric(e.sc, "kvdepot_decode_chunks_stored_total") == 1
    assert e.sched.tracked() == 0


def test_no_decode_save_for_an_aborted_request_or_with_the_setting_off(engine: Engine) -> None:
    e = engine
    blocks = list(range(1, 8))
    for n, (rid, completed, save_decode) in enumerate((("aborted", False, True), ("off", True, False))):
        prompt = list(range(100 + n, 100 + n + CHUNK + 3))
        tokens = prompt + list(range(7000, 7000 + 2 * CHUNK))
        e.sched.save_decode = save_decode
        assert ask(e.sched, rid, prompt) == (0, False)
        e.prefill(rid, prompt, blocks)
        assert not e.sched.finished(
            rid, completed=completed, tokens=tokens, num_computed=len(tokens) - 1, block_ids=blocks
        )
        assert e.next_step() == ([], set())
    assert metric(e.sc, "kvdepot_decode_chunks_stored_total") == 0


def test_a_failed_decode_save_still_reports_the_request(engine: Engine) -> None:
    e = engine
    prompt = list(range(100, 100 + CHUNK + 3))
    tokens = prompt + list(range(7000, 7000 + CHUNK))
    blocks = list(range(1, 6))
    assert ask(e.sched, "r", prompt) == (0, False)
    e.prefill("r", prompt, blocks)
    assert e.sched.finished(
        "r", completed=True, tokens=tokens, num_computed=len(tokens) - 1, block_ids=blocks
    )
    e.sc.stop()  # the sidecar is gone when the save runs
    saves, sent = e.next_step()
    assert saves == [(1, 1)]
    assert sent == {"r"}, "a failed save must still be reported, or vLLM never frees the blocks"
    assert e.worker.saved_chunks == 1  # the prompt chunk only


def test_a_preempted_request_looks_up_again_and_saves_from_its_new_blocks(engine: Engine) -> None:
    e = engine
    prompt = list(range(300, 300 + 2 * CHUNK + 7))
    assert ask(e.sched, "w", prompt) == (0, False)
    e.prefill("w", prompt, list(range(1, 6)))
    e.sched.finished("w")

    # A hit of 2 chunks, loaded; then the request is preempted (blocks freed, locks released).
    assert ask(e.sched, "r", prompt) == (2 * CHUNK, False)
    first = list(range(10, 16))
    e.sched.after_alloc("r", first, 2 * CHUNK)
    e.worker.load(e.sched.plan_step([ScheduledRequest("r", first, 2 * CHUNK, 7)]).loads)
    assert e.worker.take_load_errors() == set()
    answer = list(range(8000, 8000 + 30))
    # Resumed: vLLM asks again with the request's preemption count. A fresh lookup locks again.
    assert e.sched.matched_tokens("r", prompt, None, len(prompt) + 10, 0, preemptions=1) == (2 * CHUNK, False)
    second = list(range(30, 38))
    e.sched.after_alloc("r", second, 2 * CHUNK)
    plan = e.sched.plan_step([ScheduledRequest("r", second, 2 * CHUNK, 7 + 10)])
    assert plan.saves == []
    e.worker.load(plan.loads)
    assert e.worker.take_load_errors() == set(), "the second load must not find its locks gone"
    assert not e.worker.guard.down
    e.kv.fill(second[4:7], seed=5)
    tokens = prompt + answer
    assert e.sched.finished(
        "r", completed=True, tokens=tokens, num_computed=len(tokens) - 1, block_ids=second[:7]
    )
    plan = e.sched.plan_step([])
    assert [(s.first_chunk, s.num_chunks, s.block_ids) for s in plan.saves] == [(2, 1, tuple(second[4:6]))]
    e.worker.save(plan.saves, plan.sending)
    assert e.worker.take_sent() == {"r"}
    assert metric(e.sc, "kvdepot_decode_chunks_stored_total") == 1
