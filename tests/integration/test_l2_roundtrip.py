"""Store -> L1 eviction -> LOOKUP -> prefetch from L2 -> byte-identical RETRIEVE, per adapter,
with a real sidecar process, real files and a real Redis."""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.conftest import CLUSTER_URL, StartSidecar
from tests.integration.dp_client import LAYOUT, chunk_data, client, request_tokens
from tests.integration.redis_keys import REDIS_URL
from tests.integration.waiting import wait_for

CHUNK_BYTES = LAYOUT.chunk_bytes  # 64 KiB; 1 MiB of L1 holds 16 of them


def adapter_env(kind: str, redis_prefix: str) -> dict[str, str]:
    configs = {
        "disk": {"type": "disk", "name": "disk"},
        "slab": {"type": "slab", "name": "slab", "slot_bytes": 68 << 10, "size_bytes": 4096 + 64 * 69632},
        "redis": {"type": "redis", "name": "redis", "url": REDIS_URL, "key_prefix": redis_prefix},
        "redis-cluster": {"type": "redis", "name": "redis", "url": CLUSTER_URL, "key_prefix": redis_prefix},
        "mock": {"type": "mock", "name": "mock", "capacity_gb": 0.1},
    }
    return {
        "KVDEPOT_L1__CHUNK_SIZE": "16",
        "KVDEPOT_L2__ADAPTERS": json.dumps([configs[kind]]),
        "KVDEPOT_L2__PREFETCH_DEADLINE_MS": "5000",
    }


@pytest.mark.parametrize("kind", ["disk", "slab", "redis", "redis-cluster", "mock"])
def test_evicted_chunks_come_back_from_l2_byte_identical(
    sidecar_factory: StartSidecar, redis_prefix: str, kind: str, request: pytest.FixtureRequest
) -> None:
    if kind == "redis-cluster":
        request.getfixturevalue("redis_cluster")
    sc = sidecar_factory(env=adapter_env(kind, redis_prefix), l1_size_gb=1 / 1024)
    c = client(sc.url)
    try:
        for n, seed in enumerate((11, 12, 13), start=1):  # 24 chunks through a 16-chunk L1
            toks = request_tokens(seed, 8)
            assert c.store(toks, [chunk_data(seed, i) for i in range(8)], request_id=f"w{seed}").stored == 8
            wait_for(lambda n=n: sc.get_json("/status")["l2"]["store"]["written"] >= 8 * n)
        status = sc.get_json("/status")
        assert status["l1"]["counters"]["evicted"] >= 1
        assert status["l2"]["adapters"][0]["usage"]["objects"] >= 24

        toks = request_tokens(11, 8)
        before = c.lookup(toks, request_id="peek")
        assert before.hit_chunks < 8, "the first request should have left L1"
        c.end_request("peek")
        hit = c.lookup(toks, request_id="r11", wait=True)
        assert hit.hit_chunks == 8
        assert hit.pending_chunks == 0
        outs = [torch.empty(CHUNK_BYTES // 2, dtype=torch.float16) for _ in range(8)]
        assert c.retrieve("r11", outs)
        for i, out in enumerate(outs):
            assert torch.equal(out, chunk_data(11, i)), f"chunk {i} differs"
        after = sc.get_json("/status")
        assert after["l2"]["prefetch"]["chunks_loaded"] >= 1
        assert after["l1"]["allocator_ok"]
    finally:
        c.close()
