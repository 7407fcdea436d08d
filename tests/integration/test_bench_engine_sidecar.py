"""`kvdepot bench engine` with a real sidecar: the prefix-suffix-tuner's pool sized from the
sidecar's /status, and the sidecar's per-pass hits and L2 loads read from its /metrics.

The OpenAI server is the fake one of the unit tests (real HTTP); in place of vLLM's connector it
looks every prompt up in the real sidecar and stores the chunks it missed (a blocking data-plane
client, 16-token chunks of 64 KiB), so the sidecar's counters move as they would under an engine.
"""

from __future__ import annotations

import itertools
import json
import threading

import pytest
import torch

from app.cli import main
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import CHUNK_TOKENS, LAYOUT, client
from tests.unit.bench.engine.fake_openai import FakeServer, FakeState

pytestmark = pytest.mark.slow


def test_tuner_pool_from_a_real_sidecar_and_its_hits_per_pass(
    sidecar_factory: StartSidecar, capsys: pytest.CaptureFixture[str]
) -> None:
    # 2 MiB of L1 in 64 KiB chunks of 16 tokens: 32 chunks, 512 tokens; the default disk L2.
    sc = sidecar_factory(env={"KVDEPOT_L1__CHUNK_SIZE": str(CHUNK_TOKENS)}, l1_size_gb=2 / 1024)
    c = client(sc.url)  # registers the engine: /status now knows a chunk's bytes
    ids = itertools.count()
    lock = threading.Lock()
    blank = torch.zeros(LAYOUT.chunk_bytes // 2, dtype=torch.float16)

    def engine(prompt: list[int]) -> int:
        with lock:
            rid = f"r{next(ids)}"
            hit = c.lookup(prompt, request_id=rid, wait=True).hit_chunks
            full = len(prompt) // CHUNK_TOKENS
            if full > hit:
                tokens = prompt[: full * CHUNK_TOKENS]
                c.store(tokens, [blank] * (full - hit), request_id=rid + "w", first_chunk=hit)
            c.end_request(rid)
            return hit * CHUNK_TOKENS

    try:
        with FakeServer(FakeState(engine_hook=engine)) as server:
            code = main([
                "bench", "engine", "--quiet", "--url", server.url, "--sidecar-url", sc.http,
                "--workload", "prefix-suffix-tuner", "--context-tokens", "160", "--suffix-tokens", "24",
                "--breaker-tokens", "8", "--pool-multiple", "1.05", "--requests", "12", "--max-tokens", "1",
                "--no-warmup",
            ])  # fmt: skip
    finally:
        c.close()
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert result["capacity_tokens"] == 512 and result["pool_size"] == 5  # ceil(1.05 * 512 / 128)
    warm, measured = result["passes"]
    assert warm["sidecar"]["lookups"] == 5 and warm["sidecar"]["lookup_hit_chunks"] == 0
    side = measured["sidecar"]
    assert side["lookups"] == 12
    # Every measured prompt starts with a pooled 128-token prefix (8 chunks): the sidecar found
    # each in L1 or loaded it from the disk tier; the pool is larger than L1, so some came from disk.
    assert side["lookup_hit_chunks"] + side["l2_prefetch_loaded_chunks"] >= 12 * 8
    assert side["l2_loads"]["disk"] > 0 and side["evictions"] > 0
    assert measured["hits"]["external_hit_tokens"] >= 12 * 128
    assert measured["hits"]["external_hit_rate"] >= 0.8


def test_tuner_without_a_registered_engine_is_a_clear_error(
    sidecar_factory: StartSidecar, capsys: pytest.CaptureFixture[str]
) -> None:
    sc = sidecar_factory(env={"KVDEPOT_L1__CHUNK_SIZE": str(CHUNK_TOKENS)}, l1_size_gb=2 / 1024)
    code = main([
        "bench", "engine", "--quiet", "--url", "http://127.0.0.1:9", "--sidecar-url", sc.http,
        "--workload", "prefix-suffix-tuner",
    ])  # fmt: skip
    assert code == 2
    assert "no engine registered" in capsys.readouterr().err
