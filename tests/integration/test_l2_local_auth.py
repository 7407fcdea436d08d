"""Disk and slab tiers authenticate by default: with a real sidecar process, a blob planted in its
disk directory or slab file by another writer, built with the project's own code and its unkeyed
checksums (the same adapter, without the deployment's key), is never served after a restart: a miss,
counted in `auth_failures`, deleted from the local tier. The sidecar's own blobs, signed with the key
generated into its data dir, serve after the restart."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from storage import codec
from storage.codec import CodecOptions
from storage.disk.config import DiskAdapterConfig
from storage.registry import build_adapter
from storage.slab.config import SlabAdapterConfig
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import LAYOUT, chunk_data, client, request_tokens
from tests.integration.l2_helpers import engine_layout, request_keys
from tests.integration.test_l2_auth import store_and_wait
from tests.integration.waiting import wait_for

ADAPTERS: dict[str, dict[str, Any]] = {
    "disk": {"type": "disk", "name": "disk", "fsync": "never"},
    "slab": {
        "type": "slab", "name": "slab", "size_bytes": 4 << 20, "slot_bytes": 128 << 10, "fsync": "never",
    },
}


def _env(kind: str) -> dict[str, str]:
    return {
        "KVDEPOT_L1__CHUNK_SIZE": "16",
        "KVDEPOT_L2__ADAPTERS": json.dumps([ADAPTERS[kind]]),
        "KVDEPOT_L2__PREFETCH_DEADLINE_MS": "5000",
    }


async def _plant(kind: str, data_dir: Path, keys: list[str], payload: bytes) -> None:
    """Another writer of the tier: the project's own adapter, with `authenticate` off."""
    model = DiskAdapterConfig if kind == "disk" else SlabAdapterConfig
    config = model.model_validate(ADAPTERS[kind] | {"authenticate": False})
    adapter = build_adapter(config, data_dir)
    try:
        blobs = [codec.encode(k, engine_layout().fingerprint, payload, CodecOptions()) for k in keys]
        results = await adapter.store([(k, b) for k, b in zip(keys, blobs, strict=True)])
        assert all(r.ok for r in results), results
    finally:
        await adapter.close()


@pytest.mark.parametrize("kind", ["disk", "slab"])
def test_a_blob_planted_in_a_local_tier_with_unkeyed_checksums_is_never_served(
    sidecar_factory: StartSidecar, tmp_path: Path, kind: str
) -> None:
    data_dir = tmp_path / "data"
    sc = sidecar_factory(data_dir=data_dir, env=_env(kind), l1_size_gb=1 / 1024)
    c = client(sc.url)
    try:
        store_and_wait(sc, c, 71, 2)  # the sidecar's own blobs
    finally:
        c.close()
    sc.stop()

    planted = torch.full((LAYOUT.chunk_bytes // 2,), 7.0, dtype=torch.float16)
    victim = request_keys(72, 2)
    asyncio.run(_plant(kind, data_dir, victim, bytes(planted.view(torch.uint8).numpy())))

    sc = sidecar_factory(data_dir=data_dir, env=_env(kind), l1_size_gb=1 / 1024)
    c = client(sc.url)
    try:
        hit = c.lookup(request_tokens(72, 2), request_id="victim", wait=True)
        if hit.hit_chunks:
            outs = [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16) for _ in range(hit.hit_chunks)]
            assert c.retrieve("victim", outs)
            served = sum(torch.equal(o, planted) for o in outs)
            pytest.fail(f"{kind}: {hit.hit_chunks} chunks hit, {served} of them the planted bytes")
        stats = sc.get_json("/status")["l2"]["adapters"][0]["stats"]
        assert stats["auth_failures"] >= 1
        wait_for(lambda: sc.get_json("/status")["l2"]["adapters"][0]["usage"]["objects"] <= 3)

        own = c.lookup(request_tokens(71, 2), request_id="own", wait=True)
        assert own.hit_chunks == 2
        outs = [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16) for _ in range(2)]
        assert c.retrieve("own", outs)
        assert all(torch.equal(o, chunk_data(71, i)) for i, o in enumerate(outs))
    finally:
        c.close()
