"""The sidecar's own copies are bounded: a worst-case legal SAVE_BLOCKS (the most planes, every
block a separate copy) leaves the event loop free for another client's pings and costs bounded
memory; calls past the bounds are refused with a clear message.

The pings go to `/health`, served by the same event loop as the data plane: a data-plane PING
sent while a deferred reply goes out can wait for the next message (the ZMQ reader's edge), a
fault of the data-plane server of its own."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench.sidecar import SidecarProcess
from kvdepot_connector.client import KVDepotClient, encode_tokens
from kvdepot_connector.errors import SidecarError
from kvdepot_connector.handles import SharedTensor, export_tensor
from kvdepot_connector.protocol import Layout
from tests.integration.conftest import StartSidecar

# 1024 planes (K and V of 512 layers, the registration bound), one engine block per chunk, 128
# bytes per block and plane: every chunk is 1024 copies.
PLANES, BLOCKS, BLOCK_BYTES, CHUNK = 1024, 512, 128, 16
LAYOUT = Layout(dtype="uint8", num_layers=PLANES // 2, num_kv_heads=1, head_dim=8, block_size=CHUNK,
                kind="test-paged", chunk_size=CHUNK)  # fmt: skip
CHUNKS = 256  # 262144 block copies in one call


def rss_anon(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


class Engine:
    """An engine process's side: a KV cache in a sealed region, shared over its lifeline."""

    def __init__(self, data_dir: Path, url: str) -> None:
        self.kv = SharedTensor((PLANES, BLOCKS, BLOCK_BYTES), torch.uint8)
        self.client = KVDepotClient(url, model="m", layout=LAYOUT, map_arena=False, timeout_s=120).connect()
        self.client.share([self.kv.region()])  # over the client's lifeline
        self.handles = [export_tensor(self.kv.tensor[p], self.kv) for p in range(PLANES)]

    def close(self) -> None:
        self.client.close()
        self.kv.close()


@pytest.fixture
def engine(sidecar_factory: StartSidecar, tmp_path: Path) -> Iterator[tuple[Engine, SidecarProcess]]:
    sc = sidecar_factory(env={"KVDEPOT_L1__CHUNK_SIZE": str(CHUNK)}, l1_size_gb=0.1, data_dir=tmp_path / "sc")
    eng = Engine(tmp_path / "sc", sc.url)
    yield eng, sc
    eng.close()


def ping(sc: SidecarProcess) -> float:
    """A round trip through the sidecar's event loop (its /health), in seconds."""
    started = time.monotonic()
    with urllib.request.urlopen(f"{sc.http}/health", timeout=60) as answer:
        assert answer.read() == b"OK"
    return time.monotonic() - started


def test_a_worst_case_save_leaves_the_loop_free_and_memory_bounded(
    engine: tuple[Engine, SidecarProcess],
) -> None:
    eng, sc = engine
    pid = sc.proc.pid
    assert eng.client.register_kv_cache(eng.handles) == PLANES
    g = torch.Generator().manual_seed(5)
    eng.kv.tensor.copy_(torch.randint(0, 256, eng.kv.tensor.shape, generator=g, dtype=torch.uint8))
    blocks = list(range(0, 2 * CHUNKS, 2))  # no two consecutive: nothing merges
    tokens = encode_tokens(list(range(CHUNKS * CHUNK)))
    ping(sc)
    before = rss_anon(pid)
    done = threading.Event()
    outcome: list[object] = []

    def save() -> None:
        try:
            outcome.append(eng.client.save_blocks(tokens, request_id="big", block_ids=blocks))
        except Exception as exc:  # reported below
            outcome.append(exc)
        done.set()

    saver = threading.Thread(target=save)
    saver.start()
    pings: list[tuple[float, bool]] = []  # (latency, answered while the save was in flight)
    while not done.is_set() or not pings:
        latency = ping(sc)
        pings.append((latency, not done.is_set()))
    saver.join()
    grown = rss_anon(pid) - before
    print(
        f"pings={len(pings)} max_latency_s={max(p[0] for p in pings):.4f} rss_anon_growth={grown >> 20} MiB"
    )
    [reply] = outcome
    assert not isinstance(reply, Exception), reply
    assert reply.stored == CHUNKS  # type: ignore[attr-defined]
    # Every ping was answered while the save was being copied, or within a generous second.
    assert all(in_flight or latency < 1.0 for latency, in_flight in pings)
    assert max(p[0] for p in pings) < 1.0
    assert grown < 64 << 20
    # And the bytes are the engine's: load them back into other blocks.
    assert eng.client.lookup(tokens, request_id="back").hit_chunks == CHUNKS
    dest = list(range(1, 2 * CHUNKS, 2))
    assert eng.client.load_blocks("back", first_chunk=0, num_chunks=CHUNKS, block_ids=dest)
    assert torch.equal(eng.kv.tensor[:, dest], eng.kv.tensor[:, blocks])


def test_calls_past_the_bounds_are_refused(engine: tuple[Engine, SidecarProcess]) -> None:
    eng, _ = engine
    more = [eng.handles[0]] * (PLANES + 1)
    with pytest.raises(SidecarError, match="max_planes"):
        eng.client.register_kv_cache(more)
    assert eng.client.register_kv_cache(eng.handles) == PLANES
    tokens = encode_tokens(list(range(4 * CHUNK)))
    with pytest.raises(SidecarError, match="max_blocks_per_call"):
        eng.client.save_blocks(tokens, request_id="r", block_ids=[0] * ((1 << 16) + 1))
    huge = encode_tokens(list(range(4097 * CHUNK)))
    with pytest.raises(SidecarError, match="max_chunks_per_call"):
        eng.client.save_blocks(huge, request_id="r", block_ids=list(range(BLOCKS)))
    eng.client.ping()  # the refusals left the sidecar serving
