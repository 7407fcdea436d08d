"""Real processes for the router's tests: fake engines and a fake directory
(tests/integration/route_fakes.py) and `kvdepot route` itself, each on a free port; stdout and
stderr drained by a thread so a child never blocks on a full pipe."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]


class Proc:
    def __init__(self, args: list[str], port: int, ready_path: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVDEPOT_")}
        env["PYTHONPATH"] = f"{REPO}{os.pathsep}{REPO / 'connector'}"
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, *args], cwd=REPO, env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        try:
            self._wait(ready_path)
        except BaseException:
            self.stop()
            raise

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def _wait(self, path: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}:\n" + "\n".join(self.lines[-30:]))
            try:
                if httpx.get(self.url + path, timeout=1).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError("not answering:\n" + "\n".join(self.lines[-30:]))

    def get(self, path: str) -> Any:
        return httpx.get(self.url + path, timeout=10).json()

    def kill(self) -> None:
        """SIGKILL: the process dies at once, its connections are cut."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.kill()
        self._reader.join(timeout=2)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def fake_engine(name: str, api_key: str | None = None) -> Proc:
    port = free_port()
    args = ["-m", "tests.integration.route_fakes", "engine", "--port", str(port), "--name", name]
    return Proc(args + (["--api-key", api_key] if api_key else []), port, "/health")


def fake_directory() -> Proc:
    port = free_port()
    return Proc(["-m", "tests.integration.route_fakes", "directory", "--port", str(port)], port, "/_requests")


def router(tmp_path: Path, config: str) -> Proc:
    """`kvdepot route --config` on a free port; `config` is the TOML file's text (no port)."""
    port = free_port()
    path = tmp_path / f"route-{port}.toml"
    path.write_text(config)
    return Proc(["-m", "app.cli", "route", "--config", str(path), "--http-port", str(port)], port, "/metrics")


def engines_toml(*engines: Proc) -> str:
    return "".join(f'[[engines]]\nurl = "{e.url}"\nsidecar_id = "sc-{i}"\n' for i, e in enumerate(engines))


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus text exposition (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        metric_name, _, rest = key.partition("{")
        got = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
        if metric_name == name and got == want:
            return float(value)
    return 0.0
