"""The Redis the integration tests share (127.0.0.1:6379, started by tests/run.sh) and the keys a
test writes there: each test under a key prefix of its own, deleted from that Redis and from the
test Redis Cluster (tests/integration/cluster_nodes.py) when the test ends.

    redis_prefix (fixture, tests/integration/conftest.py) -> "kvdepot-test-1a2b3c4d:"
    new_prefix(kind) / delete_prefix(prefix): the same, for a prefix a helper owns
"""

from __future__ import annotations

import uuid

import redis

from tests.integration import cluster_nodes

REDIS_URL = "redis://127.0.0.1:6379/0"


def new_prefix(kind: str = "test") -> str:
    """A key prefix no other test uses: `kvdepot-<kind>-<8 hex digits>:`."""
    return f"kvdepot-{kind}-{uuid.uuid4().hex[:8]}:"


def delete_prefix(prefix: str) -> None:
    """Delete every key under `prefix` in the shared Redis and, when it answers, on every node of
    the test cluster."""
    with redis.Redis.from_url(REDIS_URL) as r:
        for key in r.scan_iter(match=prefix + "*", count=1000):
            r.unlink(key)
    if cluster_nodes.answers():
        cluster_nodes.delete_prefix(prefix)
