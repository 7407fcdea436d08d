"""A sidecar whose log output nobody reads keeps serving: its lines wait in the log writer's queue
(app/logs.py), never on the event loop. Before, the loop wrote each line itself and a full stdout
pipe held the data plane and /health until somebody read it."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

from bench.sidecar import stop_process
from kvdepot_connector.client import KVDepotClient
from tests.integration.dp_client import LAYOUT
from tests.integration.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


#: far more request lines than a pipe holds (64 KiB: about 300 of them)
REQUESTS = 2000


def test_a_stdout_nobody_reads_holds_neither_the_control_plane_nor_the_data_plane(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVDEPOT_")}
    env |= {"KVDEPOT_LOGGING__FORMAT": "json", "KVDEPOT_L1__CHUNK_SIZE": str(LAYOUT.chunk_size)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--http-port", "0", "--data-dir", str(tmp_path),
         "--l1-size-gb", "0.0625"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        rest = b""
        started: dict[str, str] = {}
        for line in proc.stdout:  # read up to the line with the addresses, then never again
            if b'"kvdepot_started"' in line:
                started = json.loads(line)
                break
        assert started, "the sidecar did not start"
        http_url = urllib.parse.urlsplit(started["http"])
        wait_for(lambda: _answers(started["http"] + "/ready"), timeout=120)  # the line precedes the listener
        conn = http.client.HTTPConnection(http_url.hostname or "127.0.0.1", http_url.port, timeout=60)
        try:
            for _ in range(REQUESTS):  # each one logs an http_request line
                conn.request("GET", "/status")
                resp = conn.getresponse()
                resp.read()
                assert resp.status == 200
            conn.request("GET", "/health")
            assert conn.getresponse().read() == b"OK"
        finally:
            conn.close()
        client = KVDepotClient(started["data_plane"], model="test-model", layout=LAYOUT, timeout_s=30)
        try:
            client.connect().ping()
        finally:
            client.close()
        proc.terminate()
        rest, _ = proc.communicate(timeout=60)  # read at last: every line came out, in order
    finally:
        stop_process(proc)
        if proc.stdout is not None:
            proc.stdout.close()
    events = [json.loads(line).get("event") for line in rest.splitlines()]
    dropped = sum(json.loads(line)["count"] for line in rest.splitlines() if b'"log_lines_dropped"' in line)
    assert events.count("http_request") + dropped >= REQUESTS
    assert events[-1] == "kvdepot_stopped", events[-5:]
