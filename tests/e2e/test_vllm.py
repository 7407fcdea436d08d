"""A real vLLM (CPU) driving KVDepotConnector against real sidecars.

vLLM's own prefix caching is off in every engine with the connector, so every hit comes from
kvdepot. References come from a plain vLLM without the connector (prefix caching on): its first
answer to a prompt is the full computation, its second answer comes from its own prefix cache.

About exactness: on this backend the logprobs of a prompt whose prefix KV is reused differ in the
third decimal from a full computation even inside vLLM itself (its own prefix cache does the
same), because fewer query rows go through the kernels. So a reused prompt must give the
identical tokens, and the logprobs of vLLM's own prefix-cache hit bit for bit (with chunks of one
block, i.e. exactly the tokens vLLM's cache would reuse): that proves the KV bytes are exact.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.sidecar import SidecarProcess, start_sidecar
from tests.e2e.harness import HITS, KV_ELEMENT_BYTES, Tokens, VllmServer, connector_config, prompt

BLOCK = 128
# one 128-token chunk of the 8-layer model: 8 layers x 128 KiB blocks per KV byte (2 MiB in bfloat16)
CHUNK_MB = KV_ELEMENT_BYTES
LOG_DIR = Path("/tmp")


def assert_close(got: Tokens, want: Tokens, tolerance: float = 0.05) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    assert all(abs(a - b) <= tolerance for (_, a), (_, b) in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def sidecar_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sidecar")


def disk_sidecar(data_dir: Path) -> SidecarProcess:
    # 40 chunks of L1: a second prompt pushes part of the first one out to the disk L2.
    env = {"KVDEPOT_L1__CHUNK_SIZE": str(BLOCK), "KVDEPOT_L2__PREFETCH_DEADLINE_MS": "5000"}
    return start_sidecar(data_dir, env=env, l1_size_gb=40 * CHUNK_MB / 1024)


@pytest.fixture(scope="module")
def sidecar(sidecar_dir: Path) -> Iterator[list[SidecarProcess]]:
    holder = [disk_sidecar(sidecar_dir)]  # a list: the kill test replaces it
    yield holder
    holder[0].stop()


@pytest.fixture(scope="module")
def engine(model_dir: Path, logs: Path, sidecar: list[SidecarProcess]) -> Iterator[VllmServer]:
    kv = connector_config(
        sidecar[0].url, kvdepot_chunk_size=BLOCK, kvdepot_load="sync", kvdepot_timeout_s=1.0
    )
    server = VllmServer(model_dir, logs, kv=kv, name="engine-b").wait_healthy()
    yield server
    server.stop()


def written(sc: SidecarProcess) -> int:
    return int(sc.get_json("/status")["l2"]["store"]["written"])


def wait_written(sc: SidecarProcess, at_least: int) -> None:
    import time

    deadline = time.monotonic() + 60
    while written(sc) < at_least:
        assert time.monotonic() < deadline, "write-behind did not finish"
        time.sleep(0.1)


ANSWERS: dict[str, Tokens] = {}
P1 = prompt(1, 4096)
P2 = P1[:2048] + prompt(2, 2048)


def test_same_prompt_in_two_engine_runs(
    model_dir: Path, logs: Path, reference: VllmServer, sidecar: list[SidecarProcess], engine: VllmServer
) -> None:
    kv = connector_config(sidecar[0].url, kvdepot_chunk_size=BLOCK, kvdepot_load="sync")
    first = VllmServer(model_dir, logs, kv=kv, name="engine-a")  # starts while the reference computes
    try:
        full = ANSWERS["P1 full"] = reference.complete(P1)
        from_prefix_cache = ANSWERS["P1 cached"] = reference.complete(P1)
        cold = first.wait_healthy().complete(P1)
    finally:
        first.stop()
    assert cold == full, "the connector must not change a computation it does not shortcut"
    wait_written(sidecar[0], 32)

    hits_before = engine.metric(HITS)
    warm = engine.complete(P1)  # another engine process: only the sidecar remembers P1
    assert engine.metric(HITS) - hits_before == 4096 - BLOCK  # sync: the last chunk is computed
    assert warm == from_prefix_cache, "KV bytes from kvdepot must equal vLLM's own cached KV"
    assert_close(warm, full)


def retrieved(sc: SidecarProcess) -> float:
    """RETRIEVEs the sidecar has answered."""
    return sc.dataplane_ops().get("retrieve", (0.0, 0.0))[0]


def test_shared_prefix_hits_exactly_its_full_chunks(
    reference: VllmServer, sidecar: list[SidecarProcess], engine: VllmServer
) -> None:
    expected = reference.complete(P2)  # the reference's prefix cache also holds P1's first 2048
    hits_before = engine.metric(HITS)
    retrieves = retrieved(sidecar[0])
    got = engine.complete(P2)
    assert engine.metric(HITS) - hits_before == 2048
    assert got == expected
    # The worker copied from the extents its scheduler's LOOKUP (or QUERY_PREFETCH) named.
    assert retrieved(sidecar[0]) == retrieves


def test_after_l1_eviction_the_hit_comes_back_from_disk(
    reference: VllmServer, sidecar: list[SidecarProcess], engine: VllmServer
) -> None:
    sc = sidecar[0]
    wait_written(sc, 48)  # P1's 32 chunks and P2's 16 new ones are on disk
    assert sc.get_json("/status")["l1"]["counters"]["evicted"] > 0, "P2 should have pushed P1 out of L1"
    loaded_before = sc.get_json("/status")["l2"]["prefetch"]["chunks_loaded"]
    hits_before = engine.metric(HITS)
    retrieves = retrieved(sc)
    got = engine.complete(P1)
    assert engine.metric(HITS) - hits_before == 4096 - BLOCK
    assert sc.get_json("/status")["l2"]["prefetch"]["chunks_loaded"] > loaded_before
    assert retrieved(sc) == retrieves  # named by the scheduler's last QUERY_PREFETCH, once all came
    assert got == reference.complete(P1)  # the reference answers from its own prefix cache


def test_sidecar_killed_mid_run_then_back(
    reference: VllmServer, sidecar: list[SidecarProcess], engine: VllmServer, sidecar_dir: Path
) -> None:
    prompts = [prompt(100 + i, 1024) for i in range(4)]
    expected = [reference.complete(p) for p in prompts]
    results: dict[int, Tokens | BaseException] = {}
    first_done = threading.Event()

    def run() -> None:  # one request after the other, as a client would send them
        for i, p in enumerate(prompts):
            try:
                results[i] = engine.complete(p)
            except BaseException as exc:
                results[i] = exc
            first_done.set()

    worker = threading.Thread(target=run)
    worker.start()
    assert first_done.wait(600)
    sidecar[0].proc.send_signal(signal.SIGKILL)  # no goodbye: locks, arena and socket left behind
    sidecar[0].stop()
    worker.join(600)
    assert [results[i] for i in range(len(prompts))] == expected
    # With the sidecar gone the engine still serves P1, computed in full.
    assert engine.complete(P1) == ANSWERS["P1 full"]

    # Back on the same data dir: the disk L2 still holds P1; the engine reconnects by itself.
    sidecar[0] = disk_sidecar(sidecar_dir)
    import time

    deadline = time.monotonic() + 120
    while True:
        hits_before = engine.metric(HITS)
        retrieved_before = sidecar[0].get_json("/status")["l1"]["counters"]["retrieved_chunks"]
        got = engine.complete(P1)
        retrieved = sidecar[0].get_json("/status")["l1"]["counters"]["retrieved_chunks"] - retrieved_before
        # 31 chunks loaded, named by the lookup (all 32 hits) or retrieved (the 31)
        if engine.metric(HITS) - hits_before == 4096 - BLOCK and retrieved >= 31:
            break
        assert time.monotonic() < deadline, "the engine never used the restarted sidecar"
    ref = reference.complete(P1)
    assert got == ref, {"got": got, "ref": ref, "full": ANSWERS["P1 full"], "cached": ANSWERS["P1 cached"]}
