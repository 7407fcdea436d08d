"""The engine instance nonce, against a real sidecar: the scheduler's is random per start (nothing
vLLM logs derives it), reaches the worker in the step plan only, and the worker, connected at
start under a private one, acts for the scheduler's requests once it joined; a client that knows
vLLM's engine_id (it is logged) but not the nonce touches nothing."""

from __future__ import annotations

import blake3
import pytest
import torch

from kvdepot_connector.client import KVDepotClient
from kvdepot_connector.errors import SidecarError
from kvdepot_connector.protocol import ErrorCode
from kvdepot_connector.vllm.identity import new_instance_nonce
from kvdepot_connector.vllm.scheduler import ScheduledRequest, SchedulerSide
from kvdepot_connector.vllm.worker import WorkerSide
from tests.integration.conftest import StartSidecar
from tests.integration.test_connector_sides import BLOCK, CHUNK, KV, LAYOUT, ask

ENGINE_ID = "0b7e8a4c-3f7e-4d8e-9a51-1c2d3e4f5a6b"  # vLLM's kv_transfer_config.engine_id, as logged
#: what the connector used to say HELLO with: blake3("kvdepot-instance-v1:" + engine_id)
OLD_DERIVATION = blake3.blake3(b"kvdepot-instance-v1:" + ENGINE_ID.encode()).hexdigest()


@pytest.fixture
def kv() -> KV:
    return KV()


def test_the_worker_joins_the_schedulers_random_nonce_from_the_plan(
    sidecar_factory: StartSidecar, kv: KV
) -> None:
    sc = sidecar_factory(env={"KVDEPOT_L1__CHUNK_SIZE": str(CHUNK)}, l1_size_gb=0.02)
    nonce = new_instance_nonce()
    assert len(nonce) == 64 and nonce != new_instance_nonce() and nonce != OLD_DERIVATION
    sched_client = KVDepotClient(sc.url, model="m", layout=LAYOUT, map_arena=False, instance=nonce)
    work_client = KVDepotClient(sc.url, model="m", layout=LAYOUT).connect()  # at engine start: private
    spy = KVDepotClient(sc.url, model="m", layout=LAYOUT, instance=OLD_DERIVATION).connect()
    worker = WorkerSide(work_client, kv.planes(), chunk_size=CHUNK, block_size=BLOCK)
    sched = SchedulerSide([sched_client], chunk_size=CHUNK, block_size=BLOCK, load="sync")
    try:
        assert work_client.instance != nonce
        prompt = list(range(500, 500 + 2 * CHUNK + 3))
        assert ask(sched, "r1", prompt) == (0, False)
        blocks1 = list(range(4, 9))
        kv.fill(blocks1, seed=3)
        plan = sched.plan_step([ScheduledRequest("r1", blocks1, 0, len(prompt))])
        assert plan.instance == nonce  # the only way the worker learns it
        worker.follow(plan.instance)
        worker.save(plan.saves)
        assert worker.saved_chunks == 2 and work_client.instance == nonce
        sched.finished("r1")
        written = kv.blocks(blocks1[:4])
        assert ask(sched, "r2", prompt) == (2 * CHUNK, False)  # read-locked for the scheduler's r2
        blocks2 = list(range(20, 25))
        sched.after_alloc("r2", blocks2, 2 * CHUNK)
        plan = sched.plan_step([ScheduledRequest("r2", blocks2, 2 * CHUNK, 3)])
        # Whoever read vLLM's log knows the engine_id: the old nonce it gave opens nothing now.
        with pytest.raises(SidecarError) as refused:
            spy.locked("r2", first_chunk=0, num_chunks=2)
        assert refused.value.code in (ErrorCode.NOT_FOUND, ErrorCode.NOT_OWNER)
        worker.follow(plan.instance)
        worker.load(plan.loads)
        assert worker.take_load_errors() == set()
        assert all(torch.equal(a, b) for a, b in zip(written, kv.blocks(blocks2[:4]), strict=True))
        sched.finished("r2")
        assert sc.get_json("/status")["l1"]["locked_requests"] == 0
    finally:
        spy.close()
        sched_client.close()
        work_client.close()
        kv.shared.close()


def test_a_worker_that_never_joined_cannot_load_the_schedulers_request(
    sidecar_factory: StartSidecar, kv: KV
) -> None:
    sc = sidecar_factory(env={"KVDEPOT_L1__CHUNK_SIZE": str(CHUNK)}, l1_size_gb=0.02)
    sched_client = KVDepotClient(
        sc.url, model="m", layout=LAYOUT, map_arena=False, instance=new_instance_nonce()
    )
    writer = KVDepotClient(sc.url, model="m", layout=LAYOUT).connect()
    work_client = KVDepotClient(sc.url, model="m", layout=LAYOUT).connect()
    worker = WorkerSide(work_client, kv.planes(), chunk_size=CHUNK, block_size=BLOCK)
    sched = SchedulerSide([sched_client], chunk_size=CHUNK, block_size=BLOCK, load="sync")
    try:
        prompt = list(range(900, 900 + 2 * CHUNK + 1))
        outcome = writer.store(
            prompt[: 2 * CHUNK],
            [torch.zeros(LAYOUT.chunk_bytes // 2, dtype=torch.float16)] * 2,
            request_id="w",
        )
        assert outcome.stored == 2
        assert ask(sched, "r", prompt) == (2 * CHUNK, False)
        blocks = list(range(30, 35))
        sched.after_alloc("r", blocks, 2 * CHUNK)
        plan = sched.plan_step([ScheduledRequest("r", blocks, 2 * CHUNK, 1)])
        worker.load(plan.loads)  # without follow: the request is not this worker's instance's
        assert worker.take_load_errors() == set(blocks[:4])  # reported failed: vLLM recomputes them
        sched.finished("r")
    finally:
        sched_client.close()
        writer.close()
        work_client.close()
        kv.shared.close()
