"""Sealed engine regions belong to the engine instance that shared them, and cost the sidecar no
more address space than their layout needs: a real `kvdepot serve` process, a victim engine and a
second, malicious engine instance, each sharing real sealed memfds over its own lifeline.

- The attacker reads the victim's region name in the sidecar's /proc/<pid>/maps (same uid) and
  registers KV planes naming it: refused (on main it registered, then SAVE_BLOCKS read the
  victim's blocks into the attacker's chunks and LOAD_BLOCKS wrote the attacker's bytes into the
  victim's live KV cache). A region the attacker shares under the victim's name is its own.
- A sparse sealed memfd of 2^44 bytes is refused (a region's cap), so are regions past an
  instance's total, and a region larger than the planes registered in it; a region larger than it
  declares is mapped for what it declares only (on main: all of it)."""

from __future__ import annotations

import fcntl
import os
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from bench.sidecar import SidecarProcess
from kvdepot_connector.client import KVDepotClient, encode_tokens
from kvdepot_connector.errors import SidecarError
from kvdepot_connector.handles import SharedTensor, export_tensor
from kvdepot_connector.protocol import Layout, TensorHandle
from tests.integration.conftest import StartSidecar
from tests.integration.waiting import wait_for

PLANES, BLOCKS, BLOCK_BYTES, CHUNK = 4, 16, 128, 16  # one block per chunk, 4 planes of 128 bytes
LAYOUT = Layout(dtype="uint8", num_layers=PLANES // 2, num_kv_heads=1, head_dim=8, block_size=CHUNK,
                kind="test-paged", chunk_size=CHUNK)  # fmt: skip
REGION_BYTES = PLANES * BLOCKS * BLOCK_BYTES  # 8 KiB
ENV = {"KVDEPOT_L1__CHUNK_SIZE": str(CHUNK), "KVDEPOT_L2__ADAPTERS": "[]"}
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL  # type: ignore[attr-defined]


@dataclass
class Engine:
    client: KVDepotClient
    kv: SharedTensor

    def handles(self) -> list[TensorHandle]:
        return [export_tensor(self.kv.tensor[p], self.kv) for p in range(PLANES)]

    def close(self) -> None:
        self.client.close()
        self.kv.close()


def engine(sc: SidecarProcess, seed: int, *, map_arena: bool = False) -> Engine:
    kv = SharedTensor((PLANES, BLOCKS, BLOCK_BYTES), torch.uint8)
    g = torch.Generator().manual_seed(seed)
    kv.tensor.copy_(torch.randint(0, 256, kv.tensor.shape, generator=g, dtype=torch.uint8))
    client = KVDepotClient(
        sc.url, model="m", layout=LAYOUT, map_arena=map_arena, instance=secrets.token_hex(16)
    ).connect()
    client.share([kv.region()])
    return Engine(client, kv)


def names_in_maps(pid: int) -> set[str]:
    """The engine regions the sidecar maps, as any process of its uid reads them."""
    text = Path(f"/proc/{pid}/maps").read_text()
    return set(re.findall(r"/memfd:(kvdepot-engine-[0-9a-f]+)", text))


def mapped_bytes(pid: int, name: str) -> int:
    total = 0
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if f"/memfd:{name} " in line + " ":
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            total += end - start
    return total


def sealed_memfd(name: str, size: int) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)  # sparse: nothing is allocated
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)  # type: ignore[attr-defined]
    return fd


@pytest.fixture
def sidecar(sidecar_factory: StartSidecar, tmp_path: Path) -> SidecarProcess:
    return sidecar_factory(env=ENV, l1_size_gb=0.02, data_dir=tmp_path / "sc")


@pytest.fixture
def victim(sidecar: SidecarProcess) -> Iterator[Engine]:
    eng = engine(sidecar, seed=1)
    assert eng.client.register_kv_cache(eng.handles()) == PLANES
    yield eng
    eng.close()


def forged(name: str) -> list[TensorHandle]:
    """KV planes in the region `name`, as the victim laid them out (the attacker guesses it)."""
    return [
        TensorHandle(kind="cpu-memfd", dtype="uint8", shape=[BLOCKS, BLOCK_BYTES], stride=[BLOCK_BYTES, 1],
                     offset=p * BLOCKS * BLOCK_BYTES, name=name)
        for p in range(PLANES)
    ]  # fmt: skip


def main_did(attacker: KVDepotClient, victim: Engine, before: torch.Tensor) -> str:
    """What main let the attacker do once registered: read the victim's blocks into its own
    chunks, then write its own bytes into the victim's live KV cache."""
    tokens = encode_tokens(list(range(7000, 7000 + 4 * CHUNK)))
    stored = attacker.save_blocks(tokens, request_id="steal", block_ids=[0, 1, 2, 3]).stored
    lookup = attacker.lookup(tokens, request_id="steal")
    locked = attacker.locked("steal", first_chunk=0, num_chunks=lookup.hit_chunks)
    stolen = sum(
        bytes(view.numpy()) == bytes(victim.kv.tensor[:, i].contiguous().numpy())
        for i, view in enumerate(locked.views)
    )
    attacker.release("steal", locked.oids)
    mine = encode_tokens(list(range(9000, 9000 + CHUNK)))
    attacker.store(mine, [torch.full((LAYOUT.chunk_bytes,), 0x5A, dtype=torch.uint8)], request_id="w")
    attacker.lookup(mine, request_id="write")
    attacker.load_blocks("write", first_chunk=0, num_chunks=1, block_ids=[9])
    overwritten = int((victim.kv.tensor[:, 9] != before[:, 9]).sum())
    return (
        f"{stored} chunks saved from its blocks, {stolen} read back byte-identical, {overwritten} bytes "
        "of its KV cache overwritten"
    )


def test_an_instance_cannot_register_planes_in_another_instances_region(
    sidecar: SidecarProcess, victim: Engine
) -> None:
    [name] = names_in_maps(sidecar.proc.pid)
    assert name == victim.kv.name
    before = victim.kv.tensor.clone()
    attacker = KVDepotClient(
        sidecar.url, model="m", layout=LAYOUT, map_arena=True, instance=secrets.token_hex(16)
    ).connect()
    try:
        try:
            planes = attacker.register_kv_cache(forged(name))
        except SidecarError as exc:
            refused = str(exc)
        else:
            did = main_did(attacker, victim, before)
            pytest.fail(f"registered {planes} planes in the victim's region: {did}")
        assert "no region named" in refused, refused
        # Sharing a region of its own under the victim's name gives the attacker its own region.
        own = SharedTensor((PLANES, BLOCKS, BLOCK_BYTES), torch.uint8)
        try:
            own.tensor.fill_(0x33)
            attacker.share([(name, os.dup(own.fd), own.nbytes)])
            assert attacker.register_kv_cache(forged(name)) == PLANES
            tokens = encode_tokens(list(range(8000, 8000 + 2 * CHUNK)))
            assert attacker.save_blocks(tokens, request_id="own", block_ids=[5, 6]).stored == 2
            assert victim.client.lookup(tokens, request_id="v").hit_chunks == 2
            assert victim.client.load_blocks("v", first_chunk=0, num_chunks=2, block_ids=[10, 11])
            assert bool((victim.kv.tensor[:, 10:12] == 0x33).all())  # the attacker's own bytes
        finally:
            own.close()
        # The victim's own copies still work and its cache holds only what it wrote.
        assert torch.equal(victim.kv.tensor[:, :10], before[:, :10])
        assert torch.equal(victim.kv.tensor[:, 12:], before[:, 12:])
        tokens = encode_tokens(list(range(100, 100 + 2 * CHUNK)))
        assert victim.client.save_blocks(tokens, request_id="s", block_ids=[0, 1]).stored == 2
    finally:
        attacker.close()


def test_a_huge_sparse_region_is_refused_and_only_what_is_declared_is_mapped(
    sidecar: SidecarProcess,
) -> None:
    eng = engine(sidecar, seed=2)
    pid = sidecar.proc.pid
    try:
        huge = f"kvdepot-engine-{secrets.token_hex(16)}"
        with pytest.raises(SidecarError, match="max_region_bytes"):
            eng.client.share([(huge, sealed_memfd(huge, 1 << 44), 1 << 44)])
        assert mapped_bytes(pid, huge) == 0
        # A region declared small but 2^44 bytes long: the sidecar maps what was declared.
        sly = f"kvdepot-engine-{secrets.token_hex(16)}"
        eng.client.share([(sly, sealed_memfd(sly, 1 << 44), REGION_BYTES)])
        assert 0 < mapped_bytes(pid, sly) <= REGION_BYTES, mapped_bytes(pid, sly)
        assert eng.client.register_kv_cache(eng.handles()) == PLANES
        eng.client.ping()
    finally:
        eng.close()
    # The instance gone, nothing of its regions stays mapped (opened planes included).
    wait_for(lambda: mapped_bytes(pid, eng.kv.name) + mapped_bytes(pid, sly) == 0, what="regions unmapped")


def test_regions_past_an_instances_total_and_larger_than_their_planes_are_refused(
    sidecar_factory: StartSidecar, tmp_path: Path
) -> None:
    env = ENV | {
        "KVDEPOT_TRANSFERS__MAX_REGION_BYTES": str(1 << 20),
        "KVDEPOT_TRANSFERS__MAX_REGION_BYTES_PER_INSTANCE": str(2 << 20),
    }
    sc = sidecar_factory(env=env, l1_size_gb=0.02, data_dir=tmp_path / "sc")
    eng = engine(sc, seed=3)  # shares 8 KiB
    try:
        names = [f"kvdepot-engine-{secrets.token_hex(16)}" for _ in range(3)]
        with pytest.raises(SidecarError, match="max_region_bytes="):
            eng.client.share([(names[0], sealed_memfd(names[0], 2 << 20), 2 << 20)])
        eng.client.share([(names[1], sealed_memfd(names[1], 1 << 20), 1 << 20)])
        with pytest.raises(SidecarError, match="max_region_bytes_per_instance"):
            eng.client.share([(names[2], sealed_memfd(names[2], 1 << 20), 1 << 20)])
        # Planes covering 8 KiB of a 1 MiB region: the region is larger than its layout needs.
        with pytest.raises(SidecarError, match="what its planes need"):
            eng.client.register_kv_cache(forged(names[1]))
        other = engine(sc, seed=4)  # another instance's total is its own
        try:
            assert other.client.register_kv_cache(other.handles()) == PLANES
        finally:
            other.close()
        assert eng.client.register_kv_cache(eng.handles()) == PLANES
    finally:
        eng.close()
