"""`kvdepot bench ttft`: time to first token of an OpenAI-compatible server, cold then warm.

Sends `--requests` unique prompts of `--prompt-tokens` token ids (optionally all starting with a
shared prefix of `--shared-prefix-tokens`) as streaming /v1/completions, greedy, and measures the
time until the first streamed token arrives. Pass 1 (cold) computes every prompt; pass 2 (warm)
sends the same prompts again, so a KV cache can serve them. With `--baseline-url` (the same model
served without the connector) every cold request is preceded by the same request to the baseline,
so both are measured under the same machine load: `cold_vs_baseline_p50` is the cost of the
connector when nothing is reused, `warm_speedup_vs_baseline_p50` what it gains when everything is.
Prints ONE JSON object.

With `--turns N` it measures multi-turn chats instead (bench/chat.py): turn 1 sends a prompt
of `--prompt-tokens`, every later turn the previous prompt, the previous answer's token ids and
`--turn-tokens` new ones; answers have exactly `--answer-tokens` tokens.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server under test")
    p.add_argument("--baseline-url", help="the same model without the connector (optional)")
    p.add_argument("--model", help="model name (default: the server's first model)")
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--shared-prefix-tokens", type=int, default=0, help="tokens every prompt starts with")
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--token-low", type=int, default=100, help="smallest token id used in prompts")
    p.add_argument("--token-high", type=int, default=7999, help="largest token id used in prompts")
    p.add_argument("--cache-salt", help="cache_salt sent with every request")
    p.add_argument("--seed", type=int, default=None, help="prompt seed (default: a fresh one per run)")
    p.add_argument("--timeout", type=float, default=600.0)
    chat = p.add_argument_group("multi-turn chats (--turns)")
    chat.add_argument("--turns", type=int, default=0, help="turns per chat (0: cold/warm mode)")
    chat.add_argument("--answer-tokens", type=int, default=256, help="tokens of every answer")
    chat.add_argument("--turn-tokens", type=int, default=64, help="new tokens in every later turn")
    chat.add_argument("--no-decode-url", help="the server with the connector, kvdepot_save_decode false")


class OpenAIServer:
    def __init__(self, url: str, timeout: float) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.timeout = timeout

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def first_model(self) -> str:
        conn = self._conn()
        try:
            conn.request("GET", "/v1/models")
            return str(json.loads(conn.getresponse().read())["data"][0]["id"])
        finally:
            conn.close()

    def metric(self, name: str) -> float:
        """The sum of a Prometheus metric's samples (0 when the server has none)."""
        conn = self._conn()
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        total = 0.0
        for line in text.splitlines():
            if line.startswith((name + "{", name + " ")):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def ttft(self, body: dict[str, Any], token_ids: list[int] | None = None) -> tuple[float, list[Any]]:
        """Seconds until the first streamed token, and the first choice's logprobs; the generated
        token ids are appended to `token_ids` (ask with `return_token_ids`)."""
        conn = self._conn()
        try:
            start = time.perf_counter()
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
            first: float | None = None
            tokens: list[Any] = []
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                if first is None:
                    first = time.perf_counter() - start
                choice = json.loads(line[6:])["choices"][0]
                if token_ids is not None:
                    token_ids.extend(choice.get("token_ids") or ())
                logprobs = choice.get("logprobs") or {}
                tokens.extend(
                    zip(logprobs.get("tokens", []), logprobs.get("token_logprobs", []), strict=False)
                )
            if first is None:
                raise RuntimeError("the stream ended without a token")
            return first, tokens
        finally:
            conn.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class _Prompts:
    """Random token-id prompts (every one starts with the same shared prefix) and request bodies."""

    def __init__(self, args: argparse.Namespace, model: str) -> None:
        self.args = args
        self.model = model
        self.rng = random.Random(args.seed if args.seed is not None else time.time_ns())
        self.shared = self.tokens(min(args.shared_prefix_tokens, args.prompt_tokens))
        self.prompts = [
            self.shared + self.tokens(args.prompt_tokens - len(self.shared)) for _ in range(args.requests)
        ]

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randint(self.args.token_low, self.args.token_high) for _ in range(n)]

    def body(self, prompt: list[int]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model, "prompt": prompt, "max_tokens": self.args.max_tokens, "temperature": 0,
            "logprobs": 1, "stream": True, "ignore_eos": True,
        }  # fmt: skip
        if self.args.cache_salt:
            out["cache_salt"] = self.args.cache_salt
        return out


@dataclass
class _Cold:
    seconds: list[float] = field(default_factory=list)
    baseline: list[float] = field(default_factory=list)
    first_tokens: list[list[Any]] = field(default_factory=list)


@dataclass
class _Warm:
    seconds: list[float] = field(default_factory=list)
    tokens_identical: bool = True
    logprob_max_abs_diff: float = 0.0


def _cold_pass(server: OpenAIServer, baseline: OpenAIServer | None, prompts: _Prompts) -> _Cold:
    """Every prompt once, each right after the same request to the baseline (if any)."""
    cold = _Cold()
    for prompt in prompts.prompts:
        if baseline is not None:
            seconds, _ = baseline.ttft(prompts.body(prompt))
            cold.baseline.append(seconds)
        seconds, got = server.ttft(prompts.body(prompt))
        cold.seconds.append(seconds)
        cold.first_tokens.append(got)
    return cold


def _warm_pass(server: OpenAIServer, prompts: _Prompts, cold: _Cold) -> _Warm:
    """Every prompt again; the tokens must be those of the cold pass."""
    warm = _Warm()
    for prompt, expected in zip(prompts.prompts, cold.first_tokens, strict=True):
        seconds, got = server.ttft(prompts.body(prompt))
        warm.seconds.append(seconds)
        warm.tokens_identical = warm.tokens_identical and [t for t, _ in got] == [t for t, _ in expected]
        for (_, a), (_, b) in zip(got, expected, strict=False):
            if a is not None and b is not None:
                warm.logprob_max_abs_diff = max(warm.logprob_max_abs_diff, abs(a - b))
    return warm


def _result(args: argparse.Namespace, prompts: _Prompts, cold: _Cold, warm: _Warm) -> dict[str, Any]:
    c, w, base = cold.seconds, warm.seconds, cold.baseline
    result: dict[str, Any] = {
        "cold_ttft_ms_p50": round(statistics.median(c) * 1000, 1),
        "cold_ttft_ms_p90": round(percentile(c, 0.9) * 1000, 1),
        "warm_ttft_ms_p50": round(statistics.median(w) * 1000, 1),
        "warm_ttft_ms_p90": round(percentile(w, 0.9) * 1000, 1),
        "speedup_p50": round(statistics.median(c) / statistics.median(w), 2),
        "prompt_tokens": args.prompt_tokens,
        "shared_prefix_tokens": len(prompts.shared),
        "requests": args.requests,
        # A reused prefix changes how many rows go through the kernels: logprobs may move in the
        # third decimal (vLLM's own prefix cache does the same); the tokens must not change.
        "warm_tokens_identical": warm.tokens_identical,
        "warm_logprob_max_abs_diff": round(warm.logprob_max_abs_diff, 5),
    }
    if base:
        result |= {
            "baseline_ttft_ms_p50": round(statistics.median(base) * 1000, 1),
            "baseline_ttft_ms_p90": round(percentile(base, 0.9) * 1000, 1),
            "warm_speedup_vs_baseline_p50": round(statistics.median(base) / statistics.median(w), 2),
            "cold_vs_baseline_p50": round(
                statistics.median([x / b for x, b in zip(c, base, strict=True)]), 4
            ),
        }
    return result


def run(args: argparse.Namespace) -> int:
    if args.turns > 0:
        from bench.chat import run_chats

        return run_chats(args)
    server = OpenAIServer(args.url, args.timeout)
    baseline = OpenAIServer(args.baseline_url, args.timeout) if args.baseline_url else None
    prompts = _Prompts(args, args.model or server.first_model())

    # One short request to each server first: the first request after a start is slow once.
    warmup = prompts.body(prompts.tokens(16))
    server.ttft(warmup)
    if baseline is not None:
        baseline.ttft(warmup)

    cold = _cold_pass(server, baseline, prompts)
    warm = _warm_pass(server, prompts, cold)
    print(json.dumps(_result(args, prompts, cold, warm)))
    return 0
