"""A real `kvdepot directory` process, a ZMQ forwarder that drops a range of KV-event batches on
purpose (between a sidecar and the directory), and small HTTP helpers."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import zmq

from bench.sidecar import SidecarProcess
from tests.integration.metrics_sidecar import metric
from tests.ports import free_port


class DirectoryProcess:
    def __init__(self, config: Path, port: int | None = None, token: str | None = None) -> None:
        self.port = port or free_port()
        #: the admin token its listings need (the config's `http.admin_token` unless given)
        self.token = token or tomllib.loads(config.read_text()).get("http", {}).get("admin_token")
        self.http = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "app.cli", "directory", "--config", str(config)]
        cmd += ["--http-port", str(self.port)]
        self.log = open(config.with_suffix(f".{self.port}.log"), "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, Path(self.log.name).read_text()[-3000:]
            try:
                with urllib.request.urlopen(self.http + "/health", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, "directory did not start"
            time.sleep(0.05)

    def stop(self) -> int | None:
        """SIGTERM; the exit status (None: it had to be killed after 10 s)."""
        code: int | None = self.proc.poll()
        if code is None:
            self.proc.terminate()
            try:
                code = self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return code

    def logs(self) -> str:
        return Path(self.log.name).read_text()

    def score(self, token_ids: list[int], salt: str | None = None, model: str = "test-model",
              lora: str | None = None) -> dict[str, Any]:  # fmt: skip
        body = {"model": model, "token_ids": token_ids, "cache_salt": salt, "lora_name": lora}
        status, answer = post(self.http + "/v1/score", body)
        assert status == 200, answer
        return answer

    def prefixes(self, token_ids: list[int], salt: str | None = None) -> dict[str, int]:
        return {i["id"]: i["prefix_tokens"] for i in self.score(token_ids, salt)["instances"]}

    def get(self, path: str) -> bytes:
        """A GET of the directory's, with its admin token when it has one."""
        req = urllib.request.Request(self.http + path)
        if self.token is not None:
            req.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=5) as resp:
            body: bytes = resp.read()
            return body

    def instances(self) -> dict[str, dict[str, Any]]:
        return {i["id"]: i for i in json.loads(self.get("/v1/instances"))["instances"]}

    def metric(self, name: str) -> float:
        for line in self.get("/metrics").decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0


def sent(sc: SidecarProcess) -> int:
    """KV-event batches the sidecar has published."""
    return int(metric(sc, "kvdepot_kv_events_sent_total"))


def post(url: str, body: Any, token: str | None = None, method: str = "POST") -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        exc.close()
        return exc.code, json.loads(raw) if raw else None


class DroppingForwarder:
    """SUB from a sidecar's PUB, PUB to the directory; while `dropping`, batches are read and thrown
    away (a subscriber that misses a range of the sequence)."""

    def __init__(self, upstream: str) -> None:
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.dropping = threading.Event()
        self.dropped = 0
        self.forwarded = 0
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(upstream)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.bind(self.endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(50):
                continue
            frames = self._sub.recv_multipart()
            if self.dropping.is_set():
                self.dropped += 1
            else:
                self._pub.send_multipart(frames)
                self.forwarded += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close(0)
        self._pub.close(0)
        self._ctx.term()
