"""The directory converges to what real sidecars hold: batches dropped on purpose between a sidecar
and the directory are repaired from the replay socket, or from `GET /inventory` when the sidecar's
replay buffer (2 batches) no longer has them; a sidecar restarted (new incarnation, empty L1) is
relearnt; a directory restarted relearns everything. Truth is the sidecars' own inventory."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.sidecar import SidecarProcess
from engine.keys import KVLayout
from kvdepot_connector.client import KVDepotClient
from kvdepot_connector.protocol import Layout
from storage.auth import BlobKeys, parse_secret
from tests.integration.conftest import StartSidecar
from tests.integration.directory_helpers import DirectoryProcess, DroppingForwarder, sent
from tests.integration.metrics_sidecar import metric
from tests.integration.waiting import wait_for
from tests.ports import free_port

pytestmark = pytest.mark.slow

TOKEN = "sidecar-admin-token"
DEPLOYMENT = secrets.token_hex(32)
KEY_ID = BlobKeys([parse_secret(DEPLOYMENT)]).signer.key_id.hex()
LAYOUT = Layout(
    dtype="float16", num_layers=2, num_kv_heads=2, head_dim=64, block_size=4, kind="test", chunk_size=16
)  # fmt: skip
FP = KVLayout("float16", 2, 2, 64, 4, "test", 16).fingerprint.hex()


def sidecar_env(pub: int, replay: int, **extra: str) -> dict[str, str]:
    out = {
        "KVDEPOT_L1__CHUNK_SIZE": "16", "KVDEPOT_L2__ADAPTERS": "[]", "KVDEPOT_HTTP__ADMIN_TOKEN": TOKEN,
        "KVDEPOT_EVENTS__LINGER_MS": "1", "KVDEPOT_L2__AUTH_KEYS": json.dumps([DEPLOYMENT]),
        "KVDEPOT_KV_EVENTS__ENDPOINT": f"tcp://127.0.0.1:{pub}",
        "KVDEPOT_KV_EVENTS__ALLOW_PLAINTEXT_TCP": "true",  # the directory connects over tcp
        "KVDEPOT_KV_EVENTS__REPLAY_ENDPOINT": f"tcp://127.0.0.1:{replay}",
    }  # fmt: skip
    out.update(extra)
    return out


def toml_str(value: str) -> str:
    return json.dumps(value)


def static(name: str, http: str, events: str, replay: int) -> str:
    return (
        f"[[directory.static_instances]]\nid = {toml_str(name)}\nurl = {toml_str(http)}\n"
        f'events_endpoint = {toml_str(events)}\nreplay_endpoint = "tcp://127.0.0.1:{replay}"\n'
        f'salt_key_id = "{KEY_ID}"\n'
        f'[[directory.static_instances.namespaces]]\nmodel = "test-model"\nlayout_fp = "{FP}"\n'
        f"block_size = 4\nchunk_size = 16\n"
    )


def prefix(seed: int, chunks: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 60_000, (chunks * 16,), generator=g).tolist()


def data(chunks: int) -> list[torch.Tensor]:
    return [torch.full((LAYOUT.chunk_bytes // 2,), float(i), dtype=torch.float16) for i in range(chunks)]


def store(sc: SidecarProcess, toks: list[int], salt: str = "t") -> None:
    c = KVDepotClient(sc.url, model="test-model", layout=LAYOUT, timeout_s=10).connect()
    try:
        assert c.store(toks, data(len(toks) // 16), request_id="w", cache_salt=salt).stored == len(toks) // 16
    finally:
        c.close()


def clear(sc: SidecarProcess, salt: str) -> None:
    c = KVDepotClient(sc.url, model="test-model", layout=LAYOUT, timeout_s=10).connect()
    try:
        c.clear(salt)
    finally:
        c.close()


def held(sc: SidecarProcess) -> dict[str, int]:
    """The sidecar's true holding: chunks per medium, from its inventory."""
    import urllib.request

    req = urllib.request.Request(sc.http + "/inventory", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        lines = [json.loads(line) for line in resp.read().decode().splitlines()]
    out: dict[str, int] = {}
    for line in lines:
        if line["kind"] == "chunk":
            out[line["medium"]] = out.get(line["medium"], 0) + 1
    return out


def converged(d: DirectoryProcess, sidecars: dict[str, SidecarProcess]) -> bool:
    known = d.instances()
    for name, sc in sidecars.items():
        mine = {m: n for m, n in known[name]["chunks"].items() if n}
        if mine != held(sc):
            return False
    return True


@pytest.fixture
def fleet(tmp_path: Path, sidecar_factory: StartSidecar) -> Iterator[dict[str, Any]]:
    ports = {name: (free_port(), free_port(), free_port()) for name in ("s1", "s2")}
    scs: dict[str, SidecarProcess] = {}
    fwd: dict[str, DroppingForwarder] = {}
    config = ""
    for name, (http, pub, replay) in ports.items():
        extra = {"KVDEPOT_KV_EVENTS__BUFFER": "2"} if name == "s2" else {}  # a tiny replay buffer
        scs[name] = sidecar_factory(
            "--http-port", str(http), data_dir=tmp_path / name, env=sidecar_env(pub, replay, **extra),
            l1_size_gb=0.02,
        )  # fmt: skip
        fwd[name] = DroppingForwarder(f"tcp://127.0.0.1:{pub}")
        config += static(name, scs[name].http, fwd[name].endpoint, replay)
    path = tmp_path / "directory.toml"
    path.write_text(
        f"[directory]\nsidecar_token = {toml_str(TOKEN)}\ndeployment_keys = [{toml_str(DEPLOYMENT)}]\n"
        "catchup_grace_s = 0.5\nreplay_timeout_s = 2.0\nprobe_s = 1.0\n" + config
    )
    d = DirectoryProcess(path)
    env = {"ports": ports, "sidecars": scs, "forwarders": fwd, "directory": d, "config": path,
           "factory": sidecar_factory, "tmp": tmp_path}  # fmt: skip
    try:
        wait_for(lambda: all(i["synced"] for i in d.instances().values()), 30, "the first resyncs")
        yield env
    finally:
        env["directory"].stop()
        for f in fwd.values():
            f.close()


def test_dropped_batches_restarts_and_a_restarted_directory_all_converge(fleet: dict[str, Any]) -> None:
    d: DirectoryProcess = fleet["directory"]
    s1, s2 = fleet["sidecars"]["s1"], fleet["sidecars"]["s2"]
    f1, f2 = fleet["forwarders"]["s1"], fleet["forwarders"]["s2"]
    p1, p2, p3, p4, p5 = (prefix(seed, 4) for seed in range(1, 6))
    store(s1, p1)
    store(s2, p2)
    wait_for(lambda: d.prefixes(p1, "t") == {"s1": 64, "s2": 0}, 20, "p1 on s1")
    wait_for(lambda: d.prefixes(p2, "t") == {"s1": 0, "s2": 64}, 20, "p2 on s2")
    assert d.prefixes(p1, "another-tenant") == {"s1": 0, "s2": 0}

    # batches lost between the sidecars and the directory: stores, and a removal
    lag1 = sent(s1) - f1.forwarded  # what a forwarder missed before it subscribed, if anything
    lag2 = sent(s2) - f2.forwarded
    f1.dropping.set()
    f2.dropping.set()
    store(s1, p3)
    clear(s1, "t")  # p1 and p3 leave s1: the directory never sees it live
    store(s1, p3)
    for seed in range(10, 14):  # s2: more batches than its replay buffer keeps
        store(s2, prefix(seed, 1))
    store(s2, p4)
    # every batch published meanwhile went through the forwarders (and was dropped there)
    wait_for(lambda: sent(s1) == f1.forwarded + f1.dropped + lag1, 20, "s1's batches dropped")
    wait_for(lambda: sent(s2) == f2.forwarded + f2.dropped + lag2, 20, "s2's batches dropped")
    assert f1.dropped >= 2 and f2.dropped >= 3  # s2: more than its replay buffer keeps
    f1.dropping.clear()
    f2.dropping.clear()
    store(s1, p5)  # the next live batch shows the gap
    store(s2, p5)
    wait_for(lambda: d.prefixes(p5, "t") == {"s1": 64, "s2": 64}, 20, "p5 on both")
    wait_for(lambda: d.prefixes(p1, "t") == {"s1": 0, "s2": 0}, 20, "p1 removed from s1")
    assert d.prefixes(p3, "t") == {"s1": 64, "s2": 0}
    assert d.prefixes(p4, "t") == {"s1": 0, "s2": 64}
    wait_for(lambda: converged(d, fleet["sidecars"]), 20, "the directory equal to the inventories")
    assert d.metric('kvdepot_directory_gaps_repaired_total{by="replay"}') >= 1  # s1's gap
    assert d.metric('kvdepot_directory_gaps_repaired_total{by="inventory"}') >= 1  # s2's, too old

    # s2 restarts: a new incarnation with an empty L1; its first batch shows it (sequence 0 again),
    # or its heartbeat's new incarnation, or the subscription's reconnect does first: which one
    # names the resync depends on timing
    def restart_resyncs() -> float:
        reasons = ("restart", "incarnation", "reconnect")
        return sum(d.metric(f'kvdepot_directory_resyncs_total{{reason="{r}"}}') for r in reasons)

    resyncs = restart_resyncs()
    http, pub, replay = fleet["ports"]["s2"]
    s2.stop()
    s2 = fleet["sidecars"]["s2"] = fleet["factory"](
        "--http-port", str(http), data_dir=fleet["tmp"] / "s2", env=sidecar_env(pub, replay), l1_size_gb=0.02
    )  # fmt: skip
    # the forwarder's subscription reaches the new process first (PUB/SUB: before it, a batch is
    # lost for every subscriber; the directory would learn of it at the next batch or the probe)
    wait_for(lambda: metric(s2, "kvdepot_kv_events_subscribers") >= 1, 20, "the forwarder resubscribed")
    p6 = prefix(6, 3)
    store(s2, p6)
    wait_for(lambda: d.prefixes(p6, "t")["s2"] == 48, 30, "p6 on the new s2")
    assert d.prefixes(p4, "t")["s2"] == 0  # what the old incarnation held is gone
    assert restart_resyncs() >= resyncs + 1
    wait_for(lambda: converged(d, fleet["sidecars"]), 20, "converged after the restart")

    # the last batch of a stream lost, nothing after it: the quiet stream is probed on the replay
    # socket and the batch comes from there
    lag1 = sent(s1) - f1.forwarded - f1.dropped
    f1.dropping.set()
    p7 = prefix(7, 2)
    store(s1, p7)
    wait_for(lambda: sent(s1) == f1.forwarded + f1.dropped + lag1, 20, "s1's last batch dropped")
    f1.dropping.clear()
    replayed = d.metric('kvdepot_directory_gaps_repaired_total{by="replay"}')
    wait_for(lambda: d.prefixes(p7, "t")["s1"] == 32, 20, "p7 through the probe")
    assert d.metric('kvdepot_directory_gaps_repaired_total{by="replay"}') == replayed + 1

    # the directory restarts: everything relearnt from the inventories
    before = {name: i["chunks"] for name, i in d.instances().items()}
    assert d.stop() == 0  # SIGTERM: a clean, prompt exit
    d = fleet["directory"] = DirectoryProcess(fleet["config"])
    wait_for(lambda: all(i["synced"] for i in d.instances().values()), 30, "resynced after restart")
    assert {name: i["chunks"] for name, i in d.instances().items()} == before
    assert d.prefixes(p3, "t") == {"s1": 64, "s2": 0}
    assert d.prefixes(p6, "t") == {"s1": 0, "s2": 48}
