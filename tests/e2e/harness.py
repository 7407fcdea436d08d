"""Real processes for the e2e suite: a vLLM OpenAI server (run by the .venv-vllm interpreter) and
requests against it. The sidecars are started with app.bench.sidecar like everywhere else.

Every server is started in its own session and stopped by killing its process group, so vLLM's
engine-core and worker processes never outlive a test.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"

Tokens = list[tuple[str, float]]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def build_model(out_dir: Path) -> Path:
    subprocess.run(
        [str(VLLM_PYTHON), str(REPO / "tests" / "e2e" / "make_model.py"), str(out_dir)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return out_dir


def connector_config(url: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KVDepotConnector",
        "kv_connector_module_path": "kvdepot_connector.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvdepot_url": url, **extra},
    }


class VllmServer:
    def __init__(
        self,
        model: Path,
        log_dir: Path,
        *,
        kv: dict[str, Any] | None = None,
        prefix_caching: bool = False,
        name: str = "vllm",
    ) -> None:
        self.model = str(model)
        self.port = free_port()
        self.log_path = log_dir / f"{name}-{self.port}.log"
        env = dict(os.environ)
        env.update(
            HF_HUB_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CACHE_ROOT=tempfile.mkdtemp(prefix="vllm-cache-"),
            # The same core binding with and without a connector (see shared notes): fair timings.
            VLLM_CPU_NUM_OF_RESERVED_CPU="1",
        )
        args = [
            str(VLLM_PYTHON),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--enforce-eager",
            "--block-size",
            "128",
            "--max-model-len",
            "8192",
            "--port",
            str(self.port),
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        ]
        if kv is not None:
            args += ["--kv-transfer-config", json.dumps(kv)]
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def _conn(self, timeout: float) -> contextlib.closing[http.client.HTTPConnection]:
        return contextlib.closing(http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout))

    def wait_healthy(self, timeout: float = 300.0) -> VllmServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with self._conn(2) as conn:
                    conn.request("GET", "/health")
                    healthy = conn.getresponse().status == 200
                if healthy:
                    self.complete([11, 12, 13, 14], max_tokens=1)  # the first request is slow once
                    return self
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM not healthy after {timeout} s; see {self.log_path}")

    def complete(self, prompt: list[int], *, max_tokens: int = 4, cache_salt: str | None = None) -> Tokens:
        """Greedy completion; (token, logprob) of every generated token."""
        return self.complete_ids(prompt, max_tokens=max_tokens, cache_salt=cache_salt)[0]

    def complete_ids(
        self, prompt: list[int], *, max_tokens: int = 4, cache_salt: str | None = None
    ) -> tuple[Tokens, list[int]]:
        """Greedy completion of exactly `max_tokens` tokens: (token, logprob) of every generated
        token, and their token ids (what a chat sends back as part of its next prompt)."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 1,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        with self._conn(600) as conn:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data[:500]!r}")
        choice = json.loads(data)["choices"][0]
        logprobs = choice["logprobs"]
        return list(zip(logprobs["tokens"], logprobs["token_logprobs"], strict=True)), list(
            choice["token_ids"]
        )

    def metric(self, name: str) -> float:
        with self._conn(30) as conn:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self._log.close()


def prompt(seed: int, n: int, low: int = 100, high: int = 7999) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(n)]


HITS = "vllm:external_prefix_cache_hits_total"
