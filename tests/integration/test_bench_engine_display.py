"""The live display of `kvdepot bench engine`, a real process: redrawn in a pseudo-terminal, absent
when stdout is a pipe or with --quiet. (Three CLI processes: an integration test, not a unit one.)"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit.bench.engine.fake_openai import FakeServer, FakeState

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def command(url: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "app.cli", "bench", "engine", "--url", url, "--workload", "random-prefill",
        "--prompt-tokens", "32", "--requests", "10", "--max-tokens", "4", "--concurrency", "2", *extra,
    ]  # fmt: skip


def env() -> dict[str, str]:
    out = dict(os.environ)
    out.update(TERM="xterm-256color", COLUMNS="120", LINES="40")
    out["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "connector"), out.get("PYTHONPATH", "")])
    return out


def run_in_pty(argv: list[str], timeout: float = 60.0) -> tuple[int, str]:
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env(), cwd=REPO)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return code, b"".join(chunks).decode(errors="replace")


def test_live_display_redraws_in_a_terminal() -> None:
    # About 0.2 s per request, 10 requests two at a time: a run of about a second and more.
    with FakeServer(FakeState(token_delay_s=0.06)) as server:
        code, out = run_in_pty(command(server.url))
    assert code == 0, out
    assert "\x1b[" in out  # colours and cursor moves: a terminal display
    assert out.count("TTFT ms (rolling)") >= 2  # drawn, then redrawn
    assert "\x1b[2K" in out or "\x1b[1A" in out  # a redraw clears / moves up over the last frame
    assert "10/10 done" in out and "progress" in out
    last = out[out.rindex('{"bench"') :].strip()  # after the display's last frame and cursor codes
    assert json.loads(last)["passes"][0]["requests"] == 10


@pytest.mark.parametrize("where", ["pipe", "quiet terminal"])
def test_no_display_on_a_pipe_or_with_quiet(where: str) -> None:
    with FakeServer(FakeState(token_delay_s=0.001)) as server:
        if where == "pipe":
            done = subprocess.run(
                command(server.url),
                capture_output=True,
                text=True,
                check=False,
                env=env(),
                cwd=REPO,
                timeout=60,
            )
            code, out = done.returncode, done.stdout
        else:
            code, out = run_in_pty(command(server.url, "--quiet"))
    assert code == 0
    assert "\x1b[" not in out and "TTFT ms (rolling)" not in out
    lines = [line for line in out.replace("\r", "").splitlines() if line.strip()]
    assert len(lines) == 1 and json.loads(lines[0])["errors"] == 0
