"""Restarting a real sidecar on the same data dir: after SIGKILL, with a PID that repeats (PID 1 in a
container whose /dev/shm outlives it), with a dead sidecar's PID now used by another program, and
never while another sidecar still runs there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from app.bench.sidecar import SidecarProcess
from engine.l1.arena import SHM_DIR, arena_name, instance_id
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import CHUNK_TOKENS, LAYOUT, chunk_data, client, request_tokens
from tests.integration.test_serve_process import assert_refused, get, run_serve

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


def start_with_stale_arena(data_dir: Path, stale_bytes: bytes) -> SidecarProcess:
    """Start `kvdepot serve` through a shell that first leaves an arena under the exact name the
    sidecar will use (its own PID: `exec` keeps the shell's), as a PID 1 restart finds it."""
    stale = SHM_DIR / arena_name(instance_id(data_dir), 0)
    stale_prefix = str(stale)[: -len("0")]
    script = 'printf "%s" "$STALE_BYTES" > "$STALE_PREFIX$$" && exec "$@"'
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVDEPOT_")}
    env |= ENV | {"KVDEPOT_LOGGING__FORMAT": "json", "STALE_PREFIX": stale_prefix}
    env["STALE_BYTES"] = stale_bytes.decode()
    cmd = [
        "sh", "-c", script, "sh", sys.executable, "-m", "app.cli", "serve", "--http-port", "0",
        "--data-dir", str(data_dir), "--l1-size-gb", "0.02",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1, cwd=ROOT
    )
    sidecar = SidecarProcess(proc)
    try:
        sidecar.wait_ready()
    except BaseException:
        (SHM_DIR / arena_name(instance_id(data_dir), proc.pid)).unlink(missing_ok=True)
        raise
    return sidecar


def test_a_sidecar_killed_with_sigkill_restarts_on_its_data_dir(
    sidecar_factory: StartSidecar, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    first = sidecar_factory(data_dir=data_dir, env=ENV, l1_size_gb=0.02)
    serves(first)
    left_behind = SHM_DIR / first.started["arena"]
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    assert left_behind.exists() and (data_dir / "dataplane.sock").exists()  # what SIGKILL leaves

    second = sidecar_factory(data_dir=data_dir, env=ENV, l1_size_gb=0.02)

    serves(second)
    assert not left_behind.exists()
    assert second.started["arena"] == arena_name(instance_id(data_dir), second.proc.pid)


def test_a_restart_whose_pid_repeats_replaces_the_arena_left_under_its_name(
    sidecar_factory: StartSidecar, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    sidecar = start_with_stale_arena(data_dir, b"stale bytes of the previous PID 1")
    try:
        arena = SHM_DIR / sidecar.started["arena"]
        assert sidecar.started["arena"] == arena_name(instance_id(data_dir), sidecar.proc.pid)
        assert arena.stat().st_size == int(0.02 * (1 << 30))  # recreated at its own size
        serves(sidecar)
    finally:
        sidecar.stop()
    assert not arena.exists()


def test_an_arena_named_after_a_pid_now_used_by_another_program_does_not_block_start(
    sidecar_factory: StartSidecar, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    # A dead sidecar's arena whose PID is now this test process's (alive, and no kvdepot).
    stale = SHM_DIR / arena_name(instance_id(data_dir), os.getpid())
    stale.write_bytes(b"left by a dead sidecar")
    try:
        sidecar = sidecar_factory(data_dir=data_dir, env=ENV, l1_size_gb=0.02)
        serves(sidecar)
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


def test_a_live_sidecar_keeps_its_data_dir(sidecar_factory: StartSidecar, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    first = sidecar_factory(data_dir=data_dir, env=ENV, l1_size_gb=0.02)

    second = run_serve(ROOT, "--data-dir", str(data_dir), "--http-port", "0", "--l1-size-gb", "0.02")

    line = assert_refused(second, "data_dir", str(first.proc.pid))
    assert "another kvdepot" in line
    assert (SHM_DIR / first.started["arena"]).is_file()
    serves(first)
