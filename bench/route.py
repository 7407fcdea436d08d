"""`kvdepot bench route`: what the router adds to a request, against the same engine asked directly.

Starts, each in its own process, an OpenAI server that answers at once and a directory that always
names it (bench/route_peers.py), then `kvdepot route` in front of that engine. Then, in
`--rounds` rounds, each kind of request in turn on keep-alive connections, one at a time:
`direct` (the engine itself), `score` (the directory's /v1/score itself), `ids` (through the
router, a prompt of `--prompt-tokens` token ids: a /v1/score call), `text` (through the router,
a text prompt of as many characters: a /tokenize and a /v1/score call); then streams of
`--stream-chunks` SSE events, direct and through the router. The machine runs four processes on
its cores, so what matters is the difference and the ratio measured in the same run.

Prints ONE JSON object: p50/p99 per kind in ms, `added_p50_ms_ids`, `added_p50_ms_text` (router
minus direct), `router_own_p50_ms` (what is left of `ids` once the engine's and the directory's
own times are taken off), `stream_events_per_s_direct` / `_routed` and their ratio.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.sidecar import stop_process


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=300, help="requests of each kind")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--stream-chunks", type=int, default=2000, help="SSE events of each streamed answer")
    p.add_argument("--stream-rounds", type=int, default=5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _spawn(args: list[str], port: int, path: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVDEPOT_")}
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env)  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", path)
            if conn.getresponse().status < 500:
                return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"{args} did not start")


def _post(conn: http.client.HTTPConnection, body: bytes, path: str = "/v1/completions") -> float:
    start = time.perf_counter()
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise SystemExit(f"HTTP {resp.status}: {data[:200]!r}")
    return (time.perf_counter() - start) * 1000


def _stream(conn: http.client.HTTPConnection, body: bytes) -> float:
    """Events per second of one streamed answer, counted as they are read."""
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    events = resp.read().count(b"data: ") - 1
    return events / (time.perf_counter() - start)


def _pcts(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p99 = ordered[int(0.99 * (len(ordered) - 1))]
    return {"p50": round(statistics.median(ordered), 3), "p99": round(p99, 3)}


def run(args: argparse.Namespace) -> int:
    engine_port, directory_port, router_port = _free_port(), _free_port(), _free_port()
    procs = []
    try:
        procs.append(_spawn(["-m", "bench.route_peers", "engine", "--port", str(engine_port)],
                            engine_port, "/health"))  # fmt: skip
        procs.append(_spawn(["-m", "bench.route_peers", "directory", "--port", str(directory_port)],
                            directory_port, "/health"))  # fmt: skip
        config = Path(tempfile.mkdtemp(prefix="kvdepot-bench-route-")) / "route.toml"
        config.write_text(
            f'directory_url = "http://127.0.0.1:{directory_port}"\ndirectory_timeout_ms = 1000\n'
            f'log_level = "warning"\n[[engines]]\nurl = "http://127.0.0.1:{engine_port}"\n'
            'sidecar_id = "sc-0"\n'
        )
        cli = ["-m", "app.cli", "route", "--config", str(config), "--http-port", str(router_port)]
        procs.append(_spawn(cli, router_port, "/health"))
        direct = http.client.HTTPConnection("127.0.0.1", engine_port, timeout=60)
        routed = http.client.HTTPConnection("127.0.0.1", router_port, timeout=60)
        n = args.prompt_tokens
        ids = json.dumps({"model": "base", "prompt": list(range(100, 100 + n)), "max_tokens": 1}).encode()
        text = json.dumps({"model": "base", "prompt": "x" * n, "max_tokens": 1}).encode()
        score = json.dumps({"model": "base", "token_ids": list(range(100, 100 + n)), "cache_salt": None,
                            "lora_name": None}).encode()  # fmt: skip
        scorer = http.client.HTTPConnection("127.0.0.1", directory_port, timeout=60)
        samples: dict[str, list[float]] = {"direct": [], "score": [], "ids": [], "text": []}
        for _ in range(5):  # warm-up: connections, first imports, the models list
            _post(direct, ids), _post(routed, ids), _post(routed, text), _post(scorer, score, "/v1/score")
        for _ in range(args.rounds):
            samples["direct"].append(_post(direct, ids))
            samples["score"].append(_post(scorer, score, "/v1/score"))
            samples["ids"].append(_post(routed, ids))
            samples["text"].append(_post(routed, text))
        stream = json.dumps({"model": "base", "prompt": [1, 2, 3], "stream": True,
                             "stream_chunks": args.stream_chunks}).encode()  # fmt: skip
        rates: dict[str, list[float]] = {"direct": [], "routed": []}
        for _ in range(args.stream_rounds):
            rates["direct"].append(_stream(direct, stream))
            rates["routed"].append(_stream(routed, stream))
        out: dict[str, Any] = {"bench": "route", "rounds": args.rounds, "prompt_tokens": n}
        for kind, values in samples.items():
            p = _pcts(values)
            out[f"{kind}_p50_ms"], out[f"{kind}_p99_ms"] = p["p50"], p["p99"]
        out["added_p50_ms_ids"] = round(out["ids_p50_ms"] - out["direct_p50_ms"], 3)
        out["added_p50_ms_text"] = round(out["text_p50_ms"] - out["direct_p50_ms"], 3)
        out["router_own_p50_ms"] = round(out["ids_p50_ms"] - out["direct_p50_ms"] - out["score_p50_ms"], 3)
        d, r = statistics.median(rates["direct"]), statistics.median(rates["routed"])
        out["stream_events_per_s_direct"], out["stream_events_per_s_routed"] = round(d), round(r)
        out["stream_routed_vs_direct"] = round(r / d, 3)
        print(json.dumps(out))
        return 0
    finally:
        for proc in reversed(procs):
            stop_process(proc)
