"""Restarting a real sidecar on the same data dir: after SIGKILL, whatever /dev/shm holds (the arena
is a sealed memfd: no file is ever created there, so a PID that repeats, PID 1 in a container, finds
nothing in its way), and never while another sidecar still runs there."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from bench.sidecar import SidecarProcess
from engine.l1.arena import instance_id
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import CHUNK_TOKENS, LAYOUT, chunk_data, client, request_tokens
from tests.integration.test_serve_process import assert_refused, get, run_serve

SHM_DIR = Path("/dev/shm")
ROOT = Path(__file__).resolve().parents[2]  # the sidecar runs from here: this tree's code
ENV = {"KVDEPOT_L2__ADAPTERS": "[]", "KVDEPOT_L1__CHUNK_SIZE": str(CHUNK_TOKENS)}


def serves(sidecar: SidecarProcess) -> None:
    """Ready over HTTP, and a store then a retrieve over the data plane give the bytes back."""
    assert get(sidecar.http + "/ready")[0] == 200
    c = client(sidecar.url)
    try:
        toks = request_tokens(7, 2)
        assert c.store(toks, [chunk_data(7, i) for i in range(2)], request_id="w").stored == 2
        assert c.lookup(toks, request_id="r").hit_chunks == 2
        outs = [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16) for _ in range(2)]
        assert c.retrieve("r", outs)
        assert all(torch.equal(o, chunk_data(7, i)) for i, o in enumerate(outs))
    finally:
        c.close()


def kvdepot_files() -> set[str]:
    return {p.name for p in SHM_DIR.glob("kvdepot-*")}


def test_a_sidecar_killed_with_sigkill_restarts_on_its_data_dir(
    sidecar_factory: StartSidecar, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    first = sidecar_factory(data_dir=data_dir, env=ENV, l1_size_gb=0.02)
    serves(first)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    assert (data_dir / "dataplane.sock").exists()  # what SIGKILL leaves: the socket, no arena file

    second = sidecar_factory(data_dir=data_dir, env=ENV, l1_size_gb=0.02)

    serves(second)
    assert second.started["arena"].startswith(f"kvdepot-{instance_id(data_dir)}-{second.proc.pid}-")
    assert second.started["arena"] != first.started["arena"]


def test_no_file_is_created_in_dev_shm_even_where_one_has_the_arenas_name(
    sidecar_factory: StartSidecar, tmp_path: Path
) -> None:
    """A file in /dev/shm under the name the sidecar gives its arena (a PID that repeats, or a dead
    sidecar's PID now used by another program) neither blocks the start nor is opened or touched."""
    data_dir = tmp_path / "data"
    squatter = SHM_DIR / f"kvdepot-{instance_id(data_dir)}-{os.getpid()}"
    squatter.write_bytes(b"someone else's file")
    before = kvdepot_files()
    try:
        sidecar = sidecar_factory(data_dir=data_dir, env=ENV, l1_size_gb=0.02)
        serves(sidecar)
        assert kvdepot_files() == before
        assert sidecar.get_json("/status")["l1"]["arena"] == (
            f"memfd:{sidecar.started['arena']} {int(0.02 * (1 << 30))}"
        )
        sidecar.proc.send_signal(signal.SIGKILL)
        sidecar.proc.wait(10)
        assert kvdepot_files() == before and squatter.read_bytes() == b"someone else's file"
    finally:
        squatter.unlink(missing_ok=True)


def test_a_live_sidecar_keeps_its_data_dir(sidecar_factory: StartSidecar, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    first = sidecar_factory(data_dir=data_dir, env=ENV, l1_size_gb=0.02)

    second = run_serve(ROOT, "--data-dir", str(data_dir), "--http-port", "0", "--l1-size-gb", "0.02")

    line = assert_refused(second, "data_dir", str(first.proc.pid))
    assert "another kvdepot" in line
    serves(first)
