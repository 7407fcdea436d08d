"""The vLLM connector's two halves against a real sidecar, without vLLM: the scheduler side plans
loads and saves, the worker side moves the bytes, in both transfer modes (the worker copies
through the mapped arena; or the sidecar copies itself, here through the CPU stub device, from a
KV cache in a shared-memory region)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvdepot_connector.client import KVDepotClient, encode_tokens
from kvdepot_connector.handles import SharedTensor, export_tensor
from kvdepot_connector.protocol import Layout
from kvdepot_connector.vllm.plan import LoadSpec
from kvdepot_connector.vllm.scheduler import ScheduledRequest, SchedulerSide
from kvdepot_connector.vllm.worker import WorkerSide, kv_planes
from tests.integration.conftest import StartSidecar

LAYERS, BLOCKS, HEADS, BLOCK, HEAD_DIM, CHUNK = 4, 64, 2, 16, 32, 32
LAYOUT = Layout(dtype="float16", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, block_size=BLOCK,
                kind="test-paged", chunk_size=CHUNK)  # fmt: skip
BPC = CHUNK // BLOCK


def ask(sched: SchedulerSide, rid: str, prompt: list[int]) -> tuple[int | None, bool]:
    """As vLLM does: ask again while the answer is "not known yet" (chunks arriving from L2)."""
    for _ in range(1000):
        answer = sched.matched_tokens(rid, prompt, None, len(prompt), 0)
        if answer[0] is not None:
            return answer
    raise AssertionError("the lookup never settled")


class KV:
    """A paged KV cache like vLLM's CPU one, [layer][block, heads, block_size, 2*head_dim], in shm."""

    def __init__(self) -> None:
        self.shared = SharedTensor((LAYERS, BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM), torch.float16)
        self.layers = list(self.shared.tensor.unbind(0))

    def planes(self) -> list[torch.Tensor]:
        return [p for layer in self.layers for p in kv_planes(layer, BLOCKS)]

    def fill(self, blocks: list[int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for layer in self.layers:
            for b in blocks:
                layer[b].copy_(torch.randn(layer[b].shape, generator=g).to(torch.float16))

    def blocks(self, blocks: list[int]) -> list[torch.Tensor]:
        return [layer[b].clone() for layer in self.layers for b in blocks]


@pytest.fixture
def kv() -> Iterator[KV]:
    cache = KV()
    yield cache
    cache.shared.close()


@pytest.mark.parametrize("by_sidecar", [False, True], ids=["worker-copies", "sidecar-copies"])
def test_plan_save_lookup_load_round_trip(
    sidecar_factory: StartSidecar, kv: KV, by_sidecar: bool, tmp_path: Path
) -> None:
    sc = sidecar_factory(
        env={"KVDEPOT_L1__CHUNK_SIZE": str(CHUNK)}, l1_size_gb=0.02, data_dir=tmp_path / "sc"
    )
    engine = secrets.token_hex(16)  # the scheduler and the worker of one engine instance
    sched_client = KVDepotClient(sc.url, model="m", layout=LAYOUT, map_arena=False, instance=engine)
    work_client = KVDepotClient(sc.url, model="m", layout=LAYOUT, map_arena=not by_sidecar, instance=engine)
    work_client.connect().share([kv.shared.region()])  # over the worker's lifeline
    shared = [export_tensor(p, kv.shared) for p in kv.planes()] if by_sidecar else None
    worker = WorkerSide(work_client, kv.planes(), chunk_size=CHUNK, block_size=BLOCK, shared=shared)
    sched = SchedulerSide([sched_client], chunk_size=CHUNK, block_size=BLOCK, load="sync")
    try:
        prompt = list(range(1000, 1000 + 4 * CHUNK + 5))  # 4 full chunks and a tail
        # First request: a miss; its 8 blocks are computed (filled), then saved at the end of the step.
        assert ask(sched, "r1", prompt) == (0, False)
        blocks1 = list(range(10, 19))
        kv.fill(blocks1, seed=1)
        plan = sched.plan_step([ScheduledRequest("r1", blocks1, 0, len(prompt))])
        assert [(s.first_chunk, s.num_chunks) for s in plan.saves] == [(0, 4)]
        worker.save(plan.saves)
        assert worker.saved_chunks == 4
        sched.finished("r1")
        written = kv.blocks(blocks1[:8])

        # Second request, same prompt: a hit of 4 chunks (the tail is computed), loaded into new blocks.
        assert ask(sched, "r2", prompt) == (4 * CHUNK, False)
        blocks2 = list(range(30, 39))
        sched.after_alloc("r2", blocks2, 4 * CHUNK)
        plan = sched.plan_step([ScheduledRequest("r2", blocks2, 4 * CHUNK, 5)])
        (load,) = plan.loads
        assert load == LoadSpec("r2", tuple(blocks2[:8]), 0, 4, 0, located=load.located, instance=engine)
        assert [len(r.extents) for r in load.located] == [4]  # the lookup named the hits
        assert plan.saves == []  # loaded chunks are not saved again
        worker.load(plan.loads)
        assert worker.take_load_errors() == set()
        if not by_sidecar:  # the worker copied from them: no RETRIEVE of its own
            assert worker.located_refused == 0 and "retrieve" not in sc.dataplane_ops()
        assert worker.take_finished() == set()  # a sync load is not reported as finished_recving
        loaded = kv.blocks(blocks2[:8])
        assert all(torch.equal(a, b) for a, b in zip(written, loaded, strict=True))
        sched.finished("r2")
        status = sc.get_json("/status")["l1"]
        assert status["locked_requests"] == 0
        assert status["allocator_ok"]
    finally:
        sched_client.close()
        work_client.close()


def test_a_request_asked_again_in_a_later_step_finds_the_chunks_saved_since(
    sidecar_factory: StartSidecar, kv: KV, tmp_path: Path
) -> None:
    """A request that shares its prefix with one still being computed: asked while that one's
    chunks are not saved yet, it misses; asked again in a later step (it waited for room), it
    finds them, as vLLM's own cache would. Within one step the answer is not asked again."""
    sc = sidecar_factory(env={"KVDEPOT_L1__CHUNK_SIZE": str(CHUNK)}, l1_size_gb=0.02, data_dir=tmp_path / "s")
    engine = secrets.token_hex(16)
    sched_client = KVDepotClient(sc.url, model="m", layout=LAYOUT, map_arena=False, instance=engine)
    work_client = KVDepotClient(sc.url, model="m", layout=LAYOUT, instance=engine).connect()
    worker = WorkerSide(work_client, kv.planes(), chunk_size=CHUNK, block_size=BLOCK)
    sched = SchedulerSide([sched_client], chunk_size=CHUNK, block_size=BLOCK, load="sync")
    try:
        prefix = list(range(2000, 2000 + 4 * CHUNK))
        first, second = [*prefix, 1, 2, 3], [*prefix, 4, 5, 6]
        assert ask(sched, "a", first) == (0, False)
        assert ask(sched, "b", second) == (0, False)  # not scheduled: no room this step
        blocks_a = list(range(10, 19))
        kv.fill(blocks_a, seed=3)
        plan = sched.plan_step([ScheduledRequest("a", blocks_a, 0, len(first))])
        worker.save(plan.saves)  # "a"'s four chunks, saved at the end of its step
        assert worker.saved_chunks == 4
        lookups = sc.dataplane_ops()["lookup"][0]
        assert ask(sched, "b", second) == (4 * CHUNK, False)  # a later step: asked again
        assert ask(sched, "b", second) == (4 * CHUNK, False)
        assert sc.dataplane_ops()["lookup"][0] == lookups + 1  # once in this step
        blocks_b = list(range(30, 39))
        sched.after_alloc("b", blocks_b, 4 * CHUNK)
        plan = sched.plan_step([ScheduledRequest("b", blocks_b, 4 * CHUNK, 3)])
        worker.load(plan.loads)
        assert worker.take_load_errors() == set()
        loaded = zip(kv.blocks(blocks_a[:8]), kv.blocks(blocks_b[:8]), strict=True)
        assert all(torch.equal(x, y) for x, y in loaded)
        sched.finished("a")
        sched.finished("b")
    finally:
        sched_client.close()
        work_client.close()


def test_a_load_whose_locks_are_gone_is_reported_failed(sidecar_factory: StartSidecar, kv: KV) -> None:
    sc = sidecar_factory(env={"KVDEPOT_L1__CHUNK_SIZE": str(CHUNK)}, l1_size_gb=0.02)
    client = KVDepotClient(sc.url, model="m", layout=LAYOUT)
    worker = WorkerSide(client, kv.planes(), chunk_size=CHUNK, block_size=BLOCK)
    try:
        # Nothing was looked up for this request: the sidecar holds no locks for it.
        worker.load([LoadSpec("ghost", tuple(range(8)), 0, 4, 0, asynchronous=True)])
        assert worker.take_load_errors() == set(range(8))
        assert worker.take_finished() == {"ghost"}  # vLLM waits for it: reported, and failed
        worker.load([LoadSpec("ghost-sync", tuple(range(8, 16)), 0, 4, 0)])
        assert worker.take_load_errors() == set(range(8, 16))
        assert worker.take_finished() == set()
    finally:
        client.close()


def test_sidecar_copies_refuse_handles_outside_their_region(
    sidecar_factory: StartSidecar, kv: KV, tmp_path: Path
) -> None:
    sc = sidecar_factory(
        env={"KVDEPOT_L1__CHUNK_SIZE": str(CHUNK)}, l1_size_gb=0.02, data_dir=tmp_path / "sc"
    )
    client = KVDepotClient(sc.url, model="m", layout=LAYOUT, map_arena=False)
    client.connect().share([kv.shared.region()])
    try:
        good = export_tensor(kv.planes()[0], kv.shared)
        import msgspec

        from kvdepot_connector.errors import SidecarError

        too_far = msgspec.structs.replace(good, offset=good.offset + 10**9)
        with pytest.raises(SidecarError, match="invalid_input"):
            client.register_kv_cache([too_far])
        wrong_count = [good]  # one plane where the layout needs 4
        with pytest.raises(SidecarError, match="do not add up"):
            client.register_kv_cache(wrong_count)
        with pytest.raises(SidecarError, match="registered no KV cache"):
            client.load_blocks("r", first_chunk=0, num_chunks=1, block_ids=[1, 2])
        toks = encode_tokens(list(range(CHUNK)))
        with pytest.raises(SidecarError, match="registered no KV cache"):
            client.save_blocks(toks, request_id="r", block_ids=[1, 2])
        assert sc.get_json("/ready") == {"ready": True}
    finally:
        client.close()


@pytest.mark.parametrize(
    ("load", "tail", "expect_async"),
    [("auto", 5, False), ("auto", 0, True), ("sync", 0, False), ("async", 5, True)],
    ids=["auto-tail-sync", "auto-whole-prompt-async", "sync", "async"],
)
def test_load_mode_per_request(
    sidecar_factory: StartSidecar, kv: KV, load: str, tail: int, expect_async: bool
) -> None:
    """auto loads a hit in the step that schedules the request (sync) unless the hit covers the
    whole prompt; only asynchronous loads are reported to vLLM as finished_recving."""
    sc = sidecar_factory(env={"KVDEPOT_L1__CHUNK_SIZE": str(CHUNK)}, l1_size_gb=0.02)
    engine = secrets.token_hex(16)
    sched_client = KVDepotClient(sc.url, model="m", layout=LAYOUT, map_arena=False, instance=engine)
    work_client = KVDepotClient(sc.url, model="m", layout=LAYOUT, instance=engine)
    worker = WorkerSide(work_client, kv.planes(), chunk_size=CHUNK, block_size=BLOCK)
    sched = SchedulerSide([sched_client], chunk_size=CHUNK, block_size=BLOCK, load=load)
    try:
        prompt = list(range(5000, 5000 + 4 * CHUNK + tail))
        assert ask(sched, "w", prompt) == (0, False)
        blocks = list(range(0, 9))
        kv.fill(blocks, seed=7)
        worker.save(sched.plan_step([ScheduledRequest("w", blocks, 0, len(prompt))]).saves)
        sched.finished("w")
        # The whole prompt is stored. Sync must leave a token to compute: one chunk fewer.
        hit = 4 * CHUNK if (tail or expect_async) else 3 * CHUNK
        assert ask(sched, "r", prompt) == (hit, expect_async)
        dest = list(range(20, 29))
        sched.after_alloc("r", dest, hit)
        plan = sched.plan_step([ScheduledRequest("r", dest, 0, 0 if expect_async else len(prompt) - hit)])
        assert [s.asynchronous for s in plan.loads] == [expect_async]
        worker.load(plan.loads)
        assert worker.take_load_errors() == set()
        assert worker.take_finished() == ({"r"} if expect_async else set())
        n = hit // BLOCK
        assert all(torch.equal(a, b) for a, b in zip(kv.blocks(blocks[:n]), kv.blocks(dest[:n]), strict=True))
        sched.finished("r")
    finally:
        sched_client.close()
        work_client.close()
