"""Extra keys in every tier of a real sidecar: chunks stored for one adapter (or image, or set of
prompt embeddings: the client's extra key) are never found for another one, nor for the bare
tokens, in L1, after L1 was cleared (disk and Redis), and after a restart on the same data dir.
The bytes found are always the ones stored under the same extra keys."""

from __future__ import annotations

import json
from pathlib import Path

import blake3
import pytest
import torch

from kvdepot_connector.client import KVDepotClient
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import CHUNK_TOKENS, LAYOUT, chunk_data, client, request_tokens
from tests.integration.test_tenants_l2_process import adapter_config, written_behind
from tests.integration.waiting import wait_for

CHUNKS = 3
TOKENS = request_tokens(11, CHUNKS)


def extras(name: str, chunks: int = CHUNKS) -> list[bytes]:
    """An adapter-like extra key: the same digest on every chunk."""
    return [blake3.blake3(name.encode()).digest()] * chunks


def image_at(chunk: int, name: str) -> list[bytes]:
    """An image-like extra key: only chunk `chunk` (and, chained, the later ones) depends on it."""
    return [b""] * chunk + [blake3.blake3(name.encode()).digest()]


SEEDS = {"A": 1, "B": 2, "plain": 3, "imgX": 4, "imgY": 5}
KEYS: dict[str, list[bytes]] = {
    "A": extras("adapter-A"), "B": extras("adapter-B"), "plain": [],
    "imgX": image_at(1, "image-X"), "imgY": image_at(1, "image-Y"),
}  # fmt: skip


def store_all(c: KVDepotClient) -> None:
    for name, keys in KEYS.items():
        chunks = [chunk_data(SEEDS[name], i) for i in range(CHUNKS)]
        out = c.store(TOKENS, chunks, request_id=f"w-{name}", extra_keys=keys)
        # imgX/imgY share chunk 0 with plain (no image before chunk 1): it exists already
        assert out.stored + out.existing == CHUNKS, (name, out)


def check_each_finds_only_its_own(c: KVDepotClient, wait: bool) -> None:
    for name, keys in KEYS.items():
        rid = f"r-{name}"
        hit = c.lookup(TOKENS, request_id=rid, extra_keys=keys, wait=wait).hit_chunks
        assert hit == CHUNKS, (name, hit)
        outs = [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16) for _ in range(CHUNKS)]
        assert c.retrieve(rid, outs)
        for i, out in enumerate(outs):
            # chunk 0 of the images is the plain chunk 0 (stored first): the same tokens, no image yet
            owner = "plain" if name.startswith("img") and i == 0 else name
            assert torch.equal(out, chunk_data(SEEDS[owner], i)), (name, i)
    # Keys nobody stored under: the shared plain prefix at most.
    assert c.lookup(TOKENS, request_id="r-C", extra_keys=extras("adapter-C"), wait=wait).hit_chunks == 0
    assert c.lookup(TOKENS, request_id="r-Z", extra_keys=image_at(1, "image-Z"), wait=wait).hit_chunks == 1
    c.end_request("r-C")
    c.end_request("r-Z")


def test_extra_keys_in_l1(sidecar_factory: StartSidecar, tmp_path: Path) -> None:
    env = {"KVDEPOT_L2__ADAPTERS": "[]", "KVDEPOT_L1__CHUNK_SIZE": str(CHUNK_TOKENS)}
    sc = sidecar_factory(data_dir=tmp_path / "d", env=env, l1_size_gb=0.02)
    c = client(sc.url)
    try:
        store_all(c)
        check_each_finds_only_its_own(c, wait=False)
    finally:
        c.close()


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_extra_keys_in_l2_after_l1_is_cleared_and_after_a_restart(
    sidecar_factory: StartSidecar, tmp_path: Path, redis_prefix: str, kind: str
) -> None:
    env = {
        "KVDEPOT_L1__CHUNK_SIZE": str(CHUNK_TOKENS),
        "KVDEPOT_L2__ADAPTERS": json.dumps([adapter_config(kind, redis_prefix)]),
        "KVDEPOT_L2__PREFETCH_DEADLINE_MS": "5000",
    }
    data_dir = tmp_path / "data"
    sc = sidecar_factory(data_dir=data_dir, env=env, l1_size_gb=0.02)
    c = client(sc.url)
    try:
        store_all(c)
        wait_for(lambda: written_behind(sc), what="write-behind")
        c.clear(cache_salt="")  # L1 empty: what is found comes from L2
        check_each_finds_only_its_own(c, wait=True)
    finally:
        c.close()
    sc.stop()
    again = sidecar_factory(data_dir=data_dir, env=env, l1_size_gb=0.02)
    c = client(again.url)
    try:
        check_each_finds_only_its_own(c, wait=True)
        assert again.get_json("/status")["l2"]["prefetch"]["chunks_loaded"] > 0
    finally:
        c.close()


def test_bad_extra_keys_are_refused_and_uncacheable_requests_counted(
    sidecar_factory: StartSidecar, tmp_path: Path
) -> None:
    from urllib.request import urlopen

    from kvdepot_connector.errors import KVDepotClientError
    from kvdepot_connector.protocol import Uncacheable

    env = {"KVDEPOT_L2__ADAPTERS": "[]", "KVDEPOT_L1__CHUNK_SIZE": str(CHUNK_TOKENS)}
    sc = sidecar_factory(data_dir=tmp_path / "d", env=env, l1_size_gb=0.02)
    c = client(sc.url)
    try:
        for bad in ([b"short"], [b"x" * 33]):
            with pytest.raises(KVDepotClientError, match=r"invalid_input|malformed_frame"):
                c.lookup(TOKENS, request_id="bad", extra_keys=bad)
            with pytest.raises(KVDepotClientError, match=r"invalid_input|malformed_frame"):
                c.store(TOKENS, [chunk_data(1, i) for i in range(CHUNKS)], request_id="bad", extra_keys=bad)
        c.store(TOKENS, [chunk_data(1, i) for i in range(CHUNKS)], request_id="ok")
        for _ in range(2):
            reply = c.lookup(TOKENS, request_id="u", uncacheable=Uncacheable.LORA_UNFINGERPRINTED)
            assert reply.hit_chunks == 0 and reply.total_chunks == CHUNKS
        assert c.lookup(TOKENS, request_id="ok2").hit_chunks == CHUNKS  # the service is intact
    finally:
        c.close()
    with urlopen(sc.http + "/metrics") as r:
        text = r.read().decode()
    assert 'kvdepot_uncacheable_requests_total{reason="lora_unfingerprinted"} 2.0' in text
    assert 'kvdepot_uncacheable_requests_total{reason="mm_unidentified"} 0.0' in text
