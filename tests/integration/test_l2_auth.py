"""A shared Redis is not trusted: with real sidecar processes and a second, plain Redis client as
the attacker, blobs that were not signed with the deployment's key are misses (counted; never
deleted from the shared tier: tests/integration/test_l2_unknown_key.py),
a huge value under a chunk key is refused without being read, and sidecars given the same keys
(in any order: rotation) share what they store, while the keys never show."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from bench.sidecar import SidecarProcess
from kvdepot_connector.client import KVDepotClient
from storage import codec
from storage.codec import CodecOptions
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import LAYOUT, chunk_data, client, request_tokens
from tests.integration.l2_helpers import engine_layout, request_keys
from tests.integration.redis_keys import REDIS_URL
from tests.integration.waiting import wait_for

MiB = 1 << 20
KEY_1 = "11" * 32
KEY_2 = "22" * 32


def env(prefix: str, keys: list[str] | None = None) -> dict[str, str]:
    adapter = {"type": "redis", "name": "redis", "url": REDIS_URL, "key_prefix": prefix}
    out = {
        "KVDEPOT_L1__CHUNK_SIZE": "16",
        "KVDEPOT_L2__ADAPTERS": json.dumps([adapter]),
        "KVDEPOT_L2__PREFETCH_DEADLINE_MS": "5000",
    }
    if keys is not None:
        out["KVDEPOT_L2__AUTH_KEYS"] = json.dumps(keys)
    return out


def adapter_stats(sc: SidecarProcess) -> dict[str, Any]:
    stats: dict[str, Any] = sc.get_json("/status")["l2"]["adapters"][0]["stats"]
    return stats


def well_formed_blob(key: str, payload: bytes) -> bytes:
    """What any writer can build with the public codec: right key, right layout, right checksum."""
    return codec.encode(key, engine_layout().fingerprint, payload, CodecOptions()).to_bytes()


def store_and_wait(sc: SidecarProcess, c: KVDepotClient, seed: int, chunks: int) -> None:
    toks = request_tokens(seed, chunks)
    assert c.store(toks, [chunk_data(seed, i) for i in range(chunks)], request_id=f"w{seed}").stored == chunks
    wait_for(lambda: sc.get_json("/status")["l2"]["store"]["written"] >= chunks)


def test_a_blob_planted_by_another_writer_of_the_redis_is_never_served(
    sidecar_factory: StartSidecar, redis_prefix: str, attacker: redis.Redis
) -> None:
    sc = sidecar_factory(env=env(redis_prefix), l1_size_gb=1 / 1024)
    planted = torch.full((LAYOUT.chunk_bytes // 2,), 7.0, dtype=torch.float16)
    keys = request_keys(21, 4)
    for key in keys:
        attacker.set(redis_prefix + key, well_formed_blob(key, bytes(planted.view(torch.uint8).numpy())))
    c = client(sc.url)
    try:
        hit = c.lookup(request_tokens(21, 4), request_id="victim", wait=True)
        if hit.hit_chunks:
            outs = [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16) for _ in range(hit.hit_chunks)]
            assert c.retrieve("victim", outs)
            served = sum(torch.equal(o, planted) for o in outs)
            pytest.fail(f"{hit.hit_chunks} chunks hit, {served} of them the attacker's bytes")
        stats = adapter_stats(sc)
        assert stats["auth_failures"] >= 1
        assert stats["integrity_failures"] >= stats["auth_failures"]
        assert attacker.exists(redis_prefix + keys[0]) == 1  # a shared tier: never deleted
    finally:
        c.close()


def _rss_kib(pid: int, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    assert match is not None
    return int(match.group(1))


def test_a_huge_value_under_a_chunk_key_is_refused_without_being_read(
    sidecar_factory: StartSidecar, redis_prefix: str, attacker: redis.Redis
) -> None:
    sc = sidecar_factory(env=env(redis_prefix), l1_size_gb=1 / 1024)
    (key,) = request_keys(41, 1)
    attacker.set(redis_prefix + key, b"\x5a" * (64 * MiB))  # under a 64 KiB chunk's key
    pid = sc.proc.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
    before = _rss_kib(pid, "VmRSS")
    c = client(sc.url)
    try:
        hit = c.lookup(request_tokens(41, 1), request_id="r", wait=True)
        growth_mib = (_rss_kib(pid, "VmHWM") - before) / 1024
        assert growth_mib < 16, f"the sidecar's peak memory grew by {growth_mib:.0f} MiB"
        assert hit.hit_chunks == 0
        assert adapter_stats(sc)["integrity_failures"] >= 1
        assert attacker.exists(redis_prefix + key) == 1  # a shared tier: never deleted
    finally:
        c.close()


def test_sidecars_given_the_same_keys_share_blobs_and_others_cannot_use_them(
    sidecar_factory: StartSidecar, redis_prefix: str, tmp_path: Path
) -> None:
    writer = sidecar_factory(env=env(redis_prefix, [KEY_1]), l1_size_gb=1 / 1024)
    c = client(writer.url)
    try:
        store_and_wait(writer, c, 31, 4)
    finally:
        c.close()

    rotated = sidecar_factory(env=env(redis_prefix, [KEY_2, KEY_1]), l1_size_gb=1 / 1024)  # KEY_1 verifies
    c = client(rotated.url)
    try:
        hit = c.lookup(request_tokens(31, 4), request_id="r", wait=True)
        assert hit.hit_chunks == 4
        outs = [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16) for _ in range(4)]
        assert c.retrieve("r", outs)
        assert all(torch.equal(o, chunk_data(31, i)) for i, o in enumerate(outs))
    finally:
        c.close()

    stranger_dir = tmp_path / "stranger"
    stranger = sidecar_factory(data_dir=stranger_dir, env=env(redis_prefix), l1_size_gb=1 / 1024)
    key_file = stranger_dir / "l2.key"
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    assert key_file.stat().st_size == 32
    c = client(stranger.url)
    try:
        assert c.lookup(request_tokens(31, 4), request_id="r", wait=True).hit_chunks == 0
        assert adapter_stats(stranger)["auth_failures"] >= 1
    finally:
        c.close()

    for sc in (writer, rotated):
        shown = json.dumps([sc.get_json("/status"), sc.get_json("/l2/adapters")]) + "\n".join(sc.lines)
        assert KEY_1 not in shown
        assert KEY_2 not in shown
