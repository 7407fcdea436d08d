"""A Redis Cluster node frozen (SIGSTOP) under real sidecar processes: a lookup answers within the
prefetch deadline with the prefix that ends at the first chunk on the frozen node's slots, every
byte of it right; once the node is thawed (SIGCONT) the whole request hits again."""

from __future__ import annotations

import json
import time

import torch
from redis.crc import key_slot

from tests.integration import cluster_nodes
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import LAYOUT, chunk_data, client, request_tokens
from tests.integration.l2_helpers import request_keys
from tests.integration.waiting import wait_for

CHUNKS = 8
DEADLINE_MS = 4000
AUTH_KEY = "5e" * 32
SEEDS = "redis://" + ",".join(f"127.0.0.1:{port}" for port in cluster_nodes.PORTS) + "/0"


def env(url: str, prefix: str) -> dict[str, str]:
    adapter = {"type": "redis", "name": "redis", "url": url, "key_prefix": prefix, "timeout_s": 0.5}
    return {
        "KVDEPOT_L1__CHUNK_SIZE": "16",
        "KVDEPOT_L2__ADAPTERS": json.dumps([adapter]),
        "KVDEPOT_L2__PREFETCH_DEADLINE_MS": str(DEADLINE_MS),
        "KVDEPOT_L2__AUTH_KEYS": json.dumps([AUTH_KEY]),  # sidecars sharing an L2 share its key
    }


def owners(prefix: str, seed: int) -> list[int]:
    """The port of the node that serves each chunk of request `seed`."""
    return [cluster_nodes.owner(key_slot((prefix + key).encode())) for key in request_keys(seed, CHUNKS)]


def pick(prefix: str) -> tuple[int, int, int]:
    """A request whose first chunks live on other nodes than a later one: (seed, the port to
    freeze, the chunks before the first one on it)."""
    for seed in range(300, 400):
        ports = owners(prefix, seed)
        for cut in range(2, CHUNKS - 1):
            if ports[cut] not in ports[:cut]:
                return seed, ports[cut], cut
    raise AssertionError("no request splits over the nodes")


def served(url: str, seed: int, rid: str) -> tuple[int, float]:
    """Lookup (waiting for L2), retrieve what hits, check every byte; (hit chunks, seconds)."""
    c = client(url)
    try:
        started = time.monotonic()
        hit = c.lookup(request_tokens(seed, CHUNKS), request_id=rid, wait=True)
        seconds = time.monotonic() - started
        if hit.hit_chunks:
            outs = [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16) for _ in range(hit.hit_chunks)]
            assert c.retrieve(rid, outs)
            for i, out in enumerate(outs):
                assert torch.equal(out, chunk_data(seed, i)), f"chunk {i}: wrong bytes"
        c.end_request(rid)
        return hit.hit_chunks, seconds
    finally:
        c.close()


def test_a_frozen_cluster_node_shortens_the_hit_within_the_deadline(
    sidecar_factory: StartSidecar, redis_cluster: str, redis_prefix: str
) -> None:
    seed, frozen_port, cut = pick(redis_prefix)
    writer = sidecar_factory(env=env(redis_cluster, redis_prefix))
    c = client(writer.url)
    try:
        stored = c.store(
            request_tokens(seed, CHUNKS), [chunk_data(seed, i) for i in range(CHUNKS)], request_id="w"
        )
        assert stored.stored == CHUNKS
    finally:
        c.close()
    wait_for(lambda: writer.get_json("/status")["l2"]["store"]["written"] >= CHUNKS)
    # A second sidecar with an empty L1, sharing the cluster: every hit comes from L2. It starts
    # its adapter while the node is frozen: the seed list lets it read the slot map elsewhere.
    reader = sidecar_factory(env=env(SEEDS, redis_prefix))
    with cluster_nodes.frozen(frozen_port):
        hit, seconds = served(reader.url, seed, "frozen")
        assert hit == cut  # the prefix stops at the first chunk on the frozen node
        assert seconds < DEADLINE_MS / 1000 + 2  # answered, not hung (the deadline plus slack)
        again, _ = served(reader.url, seed, "frozen-again")
        assert again == cut
    back, _ = served(reader.url, seed, "thawed")
    assert back == CHUNKS
