"""Write domains with real processes: an engine instance maps the arena read-only but for the
segments it writes, so another engine cannot overwrite its committed chunks through its mapping,
and a commit of memory never written exposes no other instance's bytes."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys

import torch

from kvdepot_connector import protocol as p
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import LAYOUT, chunk_data, client, request_tokens

ENV = {"KVDEPOT_L1__CHUNK_SIZE": "16", "KVDEPOT_L2__ADAPTERS": "[]"}


def test_another_engine_cannot_overwrite_a_committed_chunk_through_its_mapping(
    sidecar_factory: StartSidecar,
) -> None:
    sc = sidecar_factory(env=ENV, l1_size_gb=0.02)
    a = client(sc.url)  # the victim: its own engine instance
    try:
        toks = request_tokens(11, 4)
        mine = [chunk_data(11, i) for i in range(4)]
        assert a.store(toks, mine, request_id="w", cache_salt="t").stored == 4
        hostile = subprocess.run(
            [sys.executable, "-m", "tests.integration.hostile_engine", "overwrite", sc.url, "11", "4", "t"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        lines = hostile.stdout.splitlines()
        report = json.loads(lines[0])
        assert report["hit"] == 4  # it can read them (the read boundary is the sidecar)
        # The victim's chunks are as it wrote them, and its release says so.
        assert a.lookup(toks, request_id="r", cache_salt="t").hit_chunks == 4
        outs = [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16) for _ in range(4)]
        valid = a.retrieve("r", outs)
        same = [torch.equal(o, mine[i]) for i, o in enumerate(outs)]
        assert valid and all(same), f"valid={valid}, chunks as written: {same}, hostile: {lines}"
        assert "wrote" not in lines and hostile.returncode == -signal.SIGSEGV, (hostile.returncode, lines)
        assert report["mprotect"] == "EACCES", report  # its mapping cannot be made writable
        attempts = {k: v for k, v in report.items() if k.startswith("mmap_rw:")}
        assert attempts and all(v == "EACCES" for v in attempts.values()), report
        if os.geteuid() != 0:  # root reopens any file read-write: outside this boundary
            assert all(v == "EACCES" for k, v in report.items() if k.startswith("reopen_rw:")), report
        assert sc.get_json("/status")["l1"]["allocator_ok"]
    finally:
        a.close()


def test_a_commit_of_unwritten_memory_exposes_no_other_instances_bytes(sidecar_factory: StartSidecar) -> None:
    sc = sidecar_factory(env=ENV, l1_size_gb=0.02)
    other = client(sc.url)  # another tenant's engine: its chunks leave their bytes in the arena
    victim = client(sc.url)
    hostile = client(sc.url)  # a third instance, lifeline held: it commits what it never wrote
    try:
        old = [chunk_data(21, i) for i in range(4)]
        assert other.store(request_tokens(21, 4), old, request_id="o", cache_salt="x").stored == 4
        assert other.clear("x") == 4  # freed: the extents still hold its bytes
        toks = request_tokens(22, 4)
        reply = hostile.reserve(toks, request_id="m", cache_salt="victim")
        oids = [s.oid for s in reply.slots if s.status is p.SlotStatus.RESERVED]
        assert len(oids) == 4 and all(hostile.commit(oids))  # not a byte written
        assert victim.lookup(toks, request_id="v", cache_salt="victim").hit_chunks == 4
        outs = [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16) for _ in range(4)]
        assert victim.retrieve("v", outs)
        leaked = [i for i, o in enumerate(outs) if any(torch.equal(o, c) for c in old)]
        assert not leaked, f"chunks {leaked} served valid hold another instance's bytes"
        assert all(not o.view(torch.uint8).any() for o in outs)  # zeros: a segment of its own
    finally:
        other.close()
        victim.close()
        hostile.close()


def test_the_next_segment_is_granted_ahead_and_mapped_before_the_store_that_writes_it(
    sidecar_factory: StartSidecar,
) -> None:
    sc = sidecar_factory(env=ENV, l1_size_gb=0.02)  # 20 segments of 1 MiB and a bit: 16 chunks each
    a, b = client(sc.url), client(sc.url)
    try:
        first = a.reserve(request_tokens(31, 1), request_id="f", cache_salt="t").slots[0]
        arena = a._session.arena
        assert arena is not None and arena.segment > 0
        seg = first.offset // arena.segment
        ctypes.memmove(a.slot_view(first).data_ptr(), chunk_data(31, 0).data_ptr(), first.size)
        assert a.commit([first.oid]) == [True]
        # The grant of the next segment came with that store; after the commit it is being
        # mapped (or was) in the mapping's thread, so the store that starts writing it does not.
        assert arena.settle(seg + 1) or arena.writable((seg + 1) * arena.segment, 1)
        assert arena.writable((seg + 1) * arena.segment, arena.segment)
        other = b._session.arena
        assert other is not None  # another instance's mapping of both stays read-only
        assert not any(other.writable(i * arena.segment, 1) for i in (seg, seg + 1))
        n = arena.segment // LAYOUT.chunk_bytes
        toks = request_tokens(32, n + 1)  # fills the rest of `seg` and spills into `seg + 1`
        data = [chunk_data(32, i) for i in range(n + 1)]
        assert a.store(toks, data, request_id="s", cache_salt="t").stored == n + 1
        outs = [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16) for _ in range(n + 1)]
        assert a.lookup(toks, request_id="r", cache_salt="t").hit_chunks == n + 1
        assert a.retrieve("r", outs) and all(torch.equal(o, d) for o, d in zip(outs, data, strict=True))
        assert sc.get_json("/status")["l1"]["allocator_ok"]
    finally:
        a.close()
        b.close()
