"""Real processes for the e2e suite: a vLLM OpenAI server (run by the .venv-vllm interpreter) and
requests against it. The sidecars are started with bench.sidecar like everywhere else.

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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.integration.tools import VLLM_PYTHON
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]

Tokens = list[tuple[str, float]]

#: The engines' dtype. float32, not the checkpoints' bfloat16: on a CPU without AVX512-BF16/AMX torch
#: runs bfloat16 matmuls two orders of magnitude slower than float32, and the e2e suite's prefills
#: would take most of its time. The KV cache takes this dtype too.
E2E_DTYPE = "float32"
#: Bytes of one KV element in that dtype (chunk sizes in the tests scale with it).
KV_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2}[E2E_DTYPE]


def need_vllm() -> None:
    """Fail (never skip) when vLLM's venv is missing: the e2e suite is nothing without it."""
    if not VLLM_PYTHON.exists():
        pytest.fail("the e2e suite needs .venv-vllm: run tests/e2e/setup_vllm.sh (tests/run.sh does)")


def _build(script: str, *args: str | Path) -> None:
    """Run one of the checkpoint builders (tests/e2e/make_*.py) in vLLM's venv."""
    command = [str(VLLM_PYTHON), str(REPO / "tests" / "e2e" / script), *map(str, args)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def build_lora(model_dir: Path, out_dir: Path, seed: int) -> Path:
    """A random LoRA adapter for `model_dir` (tests/e2e/make_lora.py), PEFT's format."""
    _build("make_lora.py", model_dir, out_dir, "--seed", str(seed))
    return out_dir


def build_model(out_dir: Path, *options: str) -> Path:
    """The tiny Llama checkpoint of make_model.py (8 layers, hidden 1024, random weights); `options`
    are make_model.py's own (e.g. `"--vocab", "2000"`)."""
    _build("make_model.py", out_dir, *options)
    return out_dir


def build_mm_model(out_dir: Path) -> Path:
    """The tiny image+text checkpoint of make_mm_model.py (Idefics3, 64 <image> tokens per image)."""
    _build("make_mm_model.py", out_dir)
    return out_dir


def png_data_url(seed: int, width: int = 64, height: int = 48) -> str:
    """A PNG of seeded random RGB noise as a data URL: every seed gives another image, byte-stable.

    Noise, not a plain colour: after the vision tower's layer norms, plain colours look alike.
    """
    import base64
    import random
    import struct
    import zlib

    rng = random.Random(seed)
    rows = b"".join(b"\x00" + rng.randbytes(3 * width) for _ in range(height))  # filter 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(png).decode()


def image_part(seed: int) -> dict[str, Any]:
    """An OpenAI chat content part holding `png_data_url(seed)`."""
    return {"type": "image_url", "image_url": {"url": png_data_url(seed)}}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


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
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.model = str(model)
        self.ready = False  # wait_healthy succeeded: requests need not wait for the start
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
        env.update(extra_env or {})
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
        if "--dtype" not in extra_args:
            args += ["--dtype", E2E_DTYPE]
        args += list(extra_args)
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
                    self.ready = True
                    self.complete([11, 12, 13, 14], max_tokens=1)  # the first request is slow once
                    return self
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM not healthy after {timeout} s; see {self.log_path}")

    def complete(
        self,
        prompt: list[int],
        *,
        max_tokens: int = 4,
        cache_salt: str | None = None,
        model: str | None = None,
    ) -> Tokens:
        """Greedy completion; (token, logprob) of every generated token. `model` names a served LoRA
        adapter (`--lora-modules NAME=PATH`); the default is the base model."""
        return self.complete_ids(prompt, max_tokens=max_tokens, cache_salt=cache_salt, model=model)[0]

    def complete_ids(
        self,
        prompt: list[int],
        *,
        max_tokens: int = 4,
        cache_salt: str | None = None,
        model: str | None = None,
    ) -> tuple[Tokens, list[int]]:
        """Greedy completion of exactly `max_tokens` tokens: (token, logprob) of every generated
        token, and their token ids (what a chat sends back as part of its next prompt)."""
        body: dict[str, Any] = {
            "model": model if model is not None else self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 1,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        status, data = self.post("/v1/completions", body)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {data[:500]!r}")
        choice = json.loads(data)["choices"][0]
        logprobs = choice["logprobs"]
        return list(zip(logprobs["tokens"], logprobs["token_logprobs"], strict=True)), list(
            choice["token_ids"]
        )

    def _started(self) -> None:
        """Servers may be started side by side without waiting (two starts on two cores take
        little longer than one): the first request to each waits for it."""
        if not self.ready:
            self.wait_healthy()

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        """POST a JSON body (e.g. /v1/load_lora_adapter); the status and the raw answer."""
        self._started()
        with self._conn(600) as conn:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()

    def chat(self, content: list[dict[str, Any]], *, max_tokens: int = 4) -> tuple[Tokens, int]:
        """Greedy chat completion of one user message made of `content` parts (text, image_url).

        Returns (token, logprob) of every generated token and the prompt's length in tokens.
        """
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": True,
            "ignore_eos": True,
        }
        self._started()
        with self._conn(600) as conn:
            conn.request(
                "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data[:500]!r}")
        reply = json.loads(data)
        tokens = [(t["token"], t["logprob"]) for t in reply["choices"][0]["logprobs"]["content"]]
        return tokens, int(reply["usage"]["prompt_tokens"])

    def metric(self, name: str) -> float:
        self._started()
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
