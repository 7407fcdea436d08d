"""A sidecar on the default settings serves the data plane and its disk tier without torch: a store,
lookup and retrieve round trip, write-behind to disk, and (after a restart on the same data dir) a
prefetch from disk, leave libtorch unmapped in the `kvdepot serve` process (/proc/PID/maps). Only an
engine that shares memory for the sidecar to copy into brings torch in, and those copies work.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.sidecar import SidecarProcess
from kvdepot_connector.client import KVDepotClient, encode_tokens
from kvdepot_connector.handles import SharedTensor, export_tensor
from kvdepot_connector.protocol import Layout
from tests.integration.conftest import StartSidecar
from tests.integration.waiting import wait_for

CHUNK = 256  # the default l1.chunk_size
# per layer, K of the chunk's tokens then V (runs the FP8 codec quantizes): 512 KiB per chunk
LAYOUT = Layout(dtype="bfloat16", num_layers=4, num_kv_heads=2, head_dim=64, block_size=16,
                kind="layer-kv", chunk_size=CHUNK)  # fmt: skip
RUN = CHUNK * 2 * 64
CHUNKS = 6


def torch_mapped(sc: SidecarProcess) -> bool:
    return "libtorch" in Path(f"/proc/{sc.proc.pid}/maps").read_text()


def redis_mapped(sc: SidecarProcess) -> bool:
    """redis-py brings hiredis' extension in: mapped only where a Redis tier is configured (or
    something imported it anyway, as the benchmark modules once did through the command line)."""
    return "hiredis" in Path(f"/proc/{sc.proc.pid}/maps").read_text()


def tokens(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 60_000, (CHUNKS * CHUNK,), generator=g).tolist()


def chunks(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(LAYOUT.chunk_bytes // 2, generator=g).to(torch.bfloat16) for _ in range(CHUNKS)]


def connect(sc: SidecarProcess) -> KVDepotClient:
    return KVDepotClient(sc.url, model="lean-model", layout=LAYOUT, timeout_s=20).connect()


def retrieved(c: KVDepotClient, request_id: str) -> list[torch.Tensor]:
    outs = [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.bfloat16) for _ in range(CHUNKS)]
    assert c.retrieve(request_id, outs)
    return outs


@pytest.mark.parametrize("fp8", [False, True], ids=["default", "fp8-values"])
def test_serving_and_the_disk_tier_never_load_torch(
    sidecar_factory: StartSidecar, tmp_path: Path, fp8: bool
) -> None:
    # a loaded machine: a slow load from disk is not a miss here (what is asserted is torch's absence)
    env = {"KVDEPOT_L2__PREFETCH_DEADLINE_MS": "10000"}
    if fp8:
        env["KVDEPOT_L2__FP8_VALUES"] = "true"
    data_dir = tmp_path / "data"
    toks, data = tokens(1), chunks(2)

    first = sidecar_factory(env=env, data_dir=data_dir)
    with connect(first) as c:
        assert c.store(toks, data, request_id="w").stored == CHUNKS
        assert c.lookup(toks, request_id="r").hit_chunks == CHUNKS
        assert all(torch.equal(a, b) for a, b in zip(retrieved(c, "r"), data, strict=True))
        wait_for(lambda: first.get_json("/status")["l2"]["store"]["written"] >= CHUNKS, what="write-behind")
    assert not torch_mapped(first)
    assert not redis_mapped(first)
    assert first.stop() == 0

    second = sidecar_factory(env=env, data_dir=data_dir)  # the disk tier's index survives
    with connect(second) as c:
        hit = c.lookup(toks, request_id="r", wait=True)
        assert (hit.hit_chunks, hit.pending_chunks) == (CHUNKS, 0)
        back = retrieved(c, "r")
    assert second.get_json("/status")["l2"]["prefetch"]["chunks_loaded"] >= CHUNKS
    if fp8:  # K runs exact, V within FP8's error
        for got, want in zip(back, data, strict=True):
            runs, wants = got.view(-1, 2, RUN), want.view(-1, 2, RUN)
            assert torch.equal(runs[:, 0], wants[:, 0])
            assert torch.allclose(runs[:, 1].float(), wants[:, 1].float(), rtol=0.07, atol=0.05)
    else:
        assert all(torch.equal(a, b) for a, b in zip(back, data, strict=True))
    assert not torch_mapped(second)
    assert not redis_mapped(second)


# The sidecar copying an engine's KV cache itself: K and V planes of 2 layers, 128 bytes per block.
PLANES, BLOCKS, BLOCK_BYTES = 4, 64, 128
PAGED = Layout(dtype="uint8", num_layers=PLANES // 2, num_kv_heads=1, head_dim=8, block_size=16,
               kind="test-paged", chunk_size=CHUNK)  # fmt: skip


def test_an_engine_sharing_its_kv_cache_brings_torch_in_and_the_copies_work(
    sidecar_factory: StartSidecar,
) -> None:
    sc = sidecar_factory()
    kv = SharedTensor((PLANES, BLOCKS, BLOCK_BYTES), torch.uint8)
    try:
        with KVDepotClient(sc.url, model="m", layout=PAGED, map_arena=False, timeout_s=60).connect() as c:
            assert not torch_mapped(sc)
            c.share([kv.region()])  # the sidecar starts making its copies now
            assert c.register_kv_cache([export_tensor(kv.tensor[p], kv) for p in range(PLANES)]) == PLANES
            assert torch_mapped(sc)
            g = torch.Generator().manual_seed(3)
            kv.tensor.copy_(torch.randint(0, 256, kv.tensor.shape, generator=g, dtype=torch.uint8))
            toks = encode_tokens(list(range(2 * CHUNK)))
            saved = list(range(32))  # 16 blocks a chunk
            assert c.save_blocks(toks, request_id="s", block_ids=saved).stored == 2
            assert c.lookup(toks, request_id="l").hit_chunks == 2
            dest = list(range(32, 64))
            assert c.load_blocks("l", first_chunk=0, num_chunks=2, block_ids=dest)
            assert torch.equal(kv.tensor[:, dest], kv.tensor[:, saved])
    finally:
        kv.close()
