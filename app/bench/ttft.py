"""`kvdepot bench ttft`: time to first token of an OpenAI-compatible server, cold then warm.

Sends `--requests` unique prompts of `--prompt-tokens` token ids (optionally all starting with a
shared prefix of `--shared-prefix-tokens`) as streaming /v1/completions, greedy, and measures the
time until the first streamed token arrives. Pass 1 (cold) computes every prompt; pass 2 (warm)
sends the same prompts again, so a KV cache can serve them. With `--baseline-url` (the same model
served without the connector) every cold request is preceded by the same request to the baseline,
so both are measured under the same machine load: `cold_vs_baseline_p50` is the cost of the
connector when nothing is reused, `warm_speedup_vs_baseline_p50` what it gains when everything is.
Prints ONE JSON object.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import time
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


class _Server:
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

    def ttft(self, body: dict[str, Any]) -> tuple[float, list[Any]]:
        """Seconds until the first streamed token, and the first choice's logprobs."""
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
                logprobs = choice.get("logprobs") or {}
                tokens.extend(
                    zip(logprobs.get("tokens", []), logprobs.get("token_logprobs", []), strict=False)
                )
            if first is None:
                raise RuntimeError("the stream ended without a token")
            return first, tokens
        finally:
            conn.close()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(args: argparse.Namespace) -> int:
    server = _Server(args.url, args.timeout)
    baseline = _Server(args.baseline_url, args.timeout) if args.baseline_url else None
    model = args.model or server.first_model()
    rng = random.Random(args.seed if args.seed is not None else time.time_ns())

    def tokens(n: int) -> list[int]:
        return [rng.randint(args.token_low, args.token_high) for _ in range(n)]

    shared = tokens(min(args.shared_prefix_tokens, args.prompt_tokens))
    prompts = [shared + tokens(args.prompt_tokens - len(shared)) for _ in range(args.requests)]

    def body(prompt: list[int]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
            "logprobs": 1, "stream": True, "ignore_eos": True,
        }  # fmt: skip
        if args.cache_salt:
            out["cache_salt"] = args.cache_salt
        return out

    # One short request to each server first: the first request after a start is slow once.
    warmup = tokens(16)
    server.ttft(body(warmup))
    if baseline is not None:
        baseline.ttft(body(warmup))

    cold: list[float] = []
    base: list[float] = []
    first_tokens: list[list[Any]] = []
    for prompt in prompts:
        if baseline is not None:
            seconds, _ = baseline.ttft(body(prompt))
            base.append(seconds)
        seconds, got = server.ttft(body(prompt))
        cold.append(seconds)
        first_tokens.append(got)
    warm: list[float] = []
    same = True
    logprob_diff = 0.0
    for prompt, expected in zip(prompts, first_tokens, strict=True):
        seconds, got = server.ttft(body(prompt))
        warm.append(seconds)
        same = same and [t for t, _ in got] == [t for t, _ in expected]
        for (_, a), (_, b) in zip(got, expected, strict=False):
            if a is not None and b is not None:
                logprob_diff = max(logprob_diff, abs(a - b))

    result: dict[str, Any] = {
        "cold_ttft_ms_p50": round(statistics.median(cold) * 1000, 1),
        "cold_ttft_ms_p90": round(_pct(cold, 0.9) * 1000, 1),
        "warm_ttft_ms_p50": round(statistics.median(warm) * 1000, 1),
        "warm_ttft_ms_p90": round(_pct(warm, 0.9) * 1000, 1),
        "speedup_p50": round(statistics.median(cold) / statistics.median(warm), 2),
        "prompt_tokens": args.prompt_tokens,
        "shared_prefix_tokens": len(shared),
        "requests": args.requests,
        # A reused prefix changes how many rows go through the kernels: logprobs may move in the
        # third decimal (vLLM's own prefix cache does the same); the tokens must not change.
        "warm_tokens_identical": same,
        "warm_logprob_max_abs_diff": round(logprob_diff, 5),
    }
    if base:
        result |= {
            "baseline_ttft_ms_p50": round(statistics.median(base) * 1000, 1),
            "baseline_ttft_ms_p90": round(_pct(base, 0.9) * 1000, 1),
            "warm_speedup_vs_baseline_p50": round(statistics.median(base) / statistics.median(warm), 2),
            "cold_vs_baseline_p50": round(
                statistics.median([c / b for c, b in zip(cold, base, strict=True)]), 4
            ),
        }
    print(json.dumps(result))
    return 0
