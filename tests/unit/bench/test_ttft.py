"""The benchmarks as a user runs them (`kvdepot bench ...`), at tiny sizes: the one JSON object they
print, its keys, and what it says about the run. `bench ttft` talks to a fake OpenAI server.
`bench l2` sets the process's logging up (to stderr), so it runs as a process:
tests/integration/test_bench_l2_process.py."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from app.cli import main


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    status = main(list(argv))
    out = capsys.readouterr().out.strip().splitlines()
    return status, json.loads(out[-1])


class FakeOpenAI(BaseHTTPRequestHandler):
    """/v1/models names one model; /v1/completions streams one token derived from the prompt (with
    `return_token_ids`: `max_tokens` of them, with their ids); /metrics counts as "external hits"
    the longest prefix, in blocks of 16, a prompt shares with an earlier one of the same cache_salt."""

    prompts: list[list[int]] = []
    salts: list[str | None] = []
    hits = 0

    def do_GET(self) -> None:
        if self.path == "/metrics":
            text = f'vllm:external_prefix_cache_hits_total{{engine="0"}} {FakeOpenAI.hits}.0\n'
            self._send(text.encode(), "text/plain")
            return
        self._send(b'{"data": [{"id": "fake-model"}]}', "application/json")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt, salt = body["prompt"], body.get("cache_salt")
        shared = [
            next(
                (i for i, (a, b) in enumerate(zip(p, prompt, strict=False)) if a != b),
                min(len(p), len(prompt)),
            )
            for p, s in zip(self.prompts, self.salts, strict=True)
            if s == salt
        ]
        FakeOpenAI.hits += max(shared, default=0) // 16 * 16
        self.prompts.append(prompt)
        self.salts.append(salt)
        n = body["max_tokens"] if body.get("return_token_ids") else 1
        ids = [(sum(prompt) + i) % 97 for i in range(n)]
        choice: dict[str, Any] = {
            "logprobs": {"tokens": [str(t) for t in ids], "token_logprobs": [-0.25] * n}
        }
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
        chunk = {"choices": [choice]}
        self._send(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode(), "text/event-stream")

    def _send(self, data: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def openai_url() -> Iterator[str]:
    FakeOpenAI.prompts, FakeOpenAI.salts, FakeOpenAI.hits = [], [], 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    # shutdown() waits for the serving loop's next poll: 0.5 s at its default interval
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def test_bench_ttft_cold_then_warm_against_a_baseline(
    capsys: pytest.CaptureFixture[str], openai_url: str
) -> None:
    status, got = run_cli(
        capsys, "bench", "ttft", "--url", openai_url, "--baseline-url", openai_url, "--requests", "3",
        "--prompt-tokens", "32", "--shared-prefix-tokens", "8", "--seed", "7",
    )  # fmt: skip
    assert status == 0
    assert set(got) == {
        "cold_ttft_ms_p50", "cold_ttft_ms_p90", "warm_ttft_ms_p50", "warm_ttft_ms_p90", "speedup_p50",
        "prompt_tokens", "shared_prefix_tokens", "requests", "warm_tokens_identical",
        "warm_logprob_max_abs_diff", "baseline_ttft_ms_p50", "baseline_ttft_ms_p90",
        "warm_speedup_vs_baseline_p50", "cold_vs_baseline_p50",
    }  # fmt: skip
    assert (got["prompt_tokens"], got["shared_prefix_tokens"], got["requests"]) == (32, 8, 3)
    assert (got["warm_tokens_identical"], got["warm_logprob_max_abs_diff"]) == (True, 0.0)
    # A warm-up to each server; each cold prompt to the baseline, then to the server; then warm.
    prompts = FakeOpenAI.prompts
    assert len(prompts) == 2 + 3 * 2 + 3
    assert prompts[0] == prompts[1] and len(prompts[0]) == 16
    cold = prompts[2:8]
    assert cold[0::2] == cold[1::2] == prompts[8:]
    assert all(len(p) == 32 and p[:8] == prompts[8][:8] for p in prompts[8:])
    assert len({tuple(p) for p in prompts[8:]}) == 3


def test_bench_ttft_multi_turn_chats_on_three_servers(
    capsys: pytest.CaptureFixture[str], openai_url: str
) -> None:
    status, got = run_cli(
        capsys, "bench", "ttft", "--url", openai_url, "--no-decode-url", openai_url,
        "--baseline-url", openai_url, "--turns", "3", "--requests", "2", "--prompt-tokens", "40",
        "--answer-tokens", "12", "--turn-tokens", "5", "--seed", "3",
    )  # fmt: skip
    assert status == 0
    assert got["mode"] == "multi_turn"
    assert (got["turns"], got["chats"], got["first_prompt_tokens"], got["answer_tokens"]) == (3, 2, 40, 12)
    assert got["servers"] == ["decode_on", "decode_off", "no_connector"]
    assert got["answers_identical"] is True
    assert [t["prompt_tokens"] for t in got["per_turn"]] == [40, 57, 74]
    # Every turn re-sends the previous prompt: the fake (a prompt cache) hits its whole blocks.
    for server in ("decode_on", "decode_off", "no_connector"):
        assert [t[server]["hit_tokens_p50"] for t in got["per_turn"]] == [0, 32, 48]
    assert set(got["per_turn"][1]["decode_on"]) == {
        "ttft_ms_p50",
        "hit_tokens_p50",
        "ttft_vs_no_connector_p50",
    }
    assert set(got["per_turn"][1]["no_connector"]) == {"ttft_ms_p50", "hit_tokens_p50"}
    # A warm-up per server, then 2 chats x 3 turns x 3 servers; each server's chat grows by its answers.
    prompts, salts = FakeOpenAI.prompts[3:], FakeOpenAI.salts[3:]
    assert len(prompts) == 18
    assert len({s for s in salts if s is not None}) == 2 and salts[2] is None
    first, second = prompts[0], prompts[3]
    assert first == prompts[1] == prompts[2] and len(first) == 40
    assert second[:40] == first and len(second) == 57
