"""A real `kvdepot serve` process set up so that every metric family it can export is exported:
L2 adapters of each kind that counts (a disk directory, a Redis with a key prefix of the caller's
own, and a Redis adapter `gone` pointed at a port nothing listens on, so its health is down), KV
events on a loopback TCP port, the worker registry, an admin token (tenant series are shown only
to its holder), a quota that refuses chunks, a small L1 so that traffic evicts, and tracing
exported over OTLP/HTTP to a receiver in this process (bench/otlp.py).

    with observed_sidecar(tmp_path, prefix) as sc: ...          # the test's own sidecar
    load(sc, rounds) / start_load(sc, rounds, seconds)           # tests/integration/metrics_load
    scrape(sc) -> the /metrics text a scrape with the token gets
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.otlp import OtlpReceiver
from bench.sidecar import SidecarProcess, start_sidecar
from tests.integration.dp_client import CHUNK_TOKENS, LAYOUT
from tests.integration.redis_keys import REDIS_URL, delete_prefix
from tests.ports import free_port

TOKEN = "metrics-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROOT = Path(__file__).resolve().parents[2]
DEAD_ADAPTER = "gone"
TINY_QUOTA = {"l1_bytes": 2 * LAYOUT.chunk_bytes, "l2_bytes": 2 * LAYOUT.chunk_bytes}


def config_text(redis_prefix: str, dead_port: int) -> str:
    return f"""
[[l2.adapters]]
type = "disk"
name = "disk"
fsync = "never"

[[l2.adapters]]
type = "redis"
name = "shared"
url = "{REDIS_URL}"
key_prefix = "{redis_prefix}"

[[l2.adapters]]
type = "redis"
name = "{DEAD_ADAPTER}"
url = "redis://127.0.0.1:{dead_port}/0"
timeout_s = 0.5
"""


@contextmanager
def observed_sidecar(tmp: Path, redis_prefix: str) -> Iterator[SidecarProcess]:
    """Start the sidecar (its quota for tenant `tiny` set), yield it, stop it, and delete the
    keys it wrote under `redis_prefix`."""
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "kvdepot.toml"
    config.write_text(config_text(redis_prefix, free_port()))
    receiver = OtlpReceiver()
    env = {
        "KVDEPOT_HTTP__ADMIN_TOKEN": TOKEN,
        "KVDEPOT_L1__CHUNK_SIZE": str(CHUNK_TOKENS),
        "KVDEPOT_TRACING__OTLP_ENDPOINT": receiver.endpoint,
        "KVDEPOT_KV_EVENTS__ALLOW_PLAINTEXT_TCP": "true",
    }
    try:
        sc = start_sidecar(
            tmp / "data", "--config", str(config), "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}",
            env=env, l1_size_gb=4 / 1024,
        )  # fmt: skip
    except BaseException:
        receiver.stop()
        raise
    try:
        put = urllib.request.Request(
            sc.http + "/quotas/tiny", data=json.dumps(TINY_QUOTA).encode(), method="PUT",
            headers=AUTH | {"content-type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(put, timeout=10) as resp:
            assert resp.status == 200
        yield sc
    finally:
        sc.stop()
        receiver.stop()
        delete_prefix(redis_prefix)


def load_command(sc: SidecarProcess, rounds: int, seconds: float = 600.0, pause: float = 0.0) -> list[str]:
    return [sys.executable, "-m", "tests.integration.metrics_load", sc.url, str(rounds), str(seconds),
            str(pause)]  # fmt: skip


def load(sc: SidecarProcess, rounds: int) -> dict[str, int]:
    """Run `rounds` rounds of metrics_load to the end; its figures."""
    done = subprocess.run(load_command(sc, rounds), capture_output=True, text=True, timeout=300, cwd=ROOT,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    figures: dict[str, int] = json.loads(done.stdout.splitlines()[-1])
    return figures


def start_load(sc: SidecarProcess, rounds: int, seconds: float, pause: float) -> subprocess.Popen[str]:
    """metrics_load in the background: `rounds` rounds at most, for `seconds` at most, `pause`
    seconds between rounds."""
    return subprocess.Popen(load_command(sc, rounds, seconds, pause), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip


def scrape(sc: SidecarProcess, token: bool = True) -> str:
    """The /metrics text of `sc`, read with this module's admin token (`token`) or without one."""
    req = urllib.request.Request(sc.http + "/metrics", headers=AUTH if token else {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return str(resp.read().decode())


def metric(sc: SidecarProcess, name: str) -> float:
    """One unlabelled sample of any sidecar's /metrics (read without a token)."""
    found = re.search(rf"^{re.escape(name)} (\S+)$", scrape(sc, token=False), re.MULTILINE)
    assert found, f"{name} not exported"
    return float(found.group(1))
