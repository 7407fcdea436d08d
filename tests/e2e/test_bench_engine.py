"""`kvdepot bench engine` against a real vLLM whose vocabulary (2000 ids) is smaller than the
default token range (100-7999): without --tokenizer the range comes from the server (the largest id
it accepts), and a range forced beyond the vocabulary gets every refusal reported with vLLM's own
status and message. The CLI runs as its own process, like a user's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.harness import REPO, VllmServer, build_model, need_vllm

VOCAB = 2000
SMALL = ["--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    need_vllm()
    model = build_model(tmp_path_factory.mktemp("model") / "llama-vocab2000", "--vocab", str(VOCAB), *SMALL)
    assert json.loads((model / "config.json").read_text())["vocab_size"] == VOCAB
    vllm = VllmServer(model, tmp_path_factory.mktemp("logs"))
    vllm.wait_healthy()
    yield vllm
    vllm.stop()


def bench(server: VllmServer, *extra: str) -> tuple[int, dict[str, Any], str]:
    """One `kvdepot bench engine` process: its exit status, its JSON object, its stderr."""
    cmd = [
        sys.executable, "-m", "app.cli", "bench", "engine", "--url", f"http://127.0.0.1:{server.port}",
        "--workload", "random-prefill", "--prompt-tokens", "64", "--requests", "6", "--max-tokens", "2",
        "--concurrency", "2", "--quiet", *extra,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=REPO, timeout=600)
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout), done.stderr


def test_the_token_range_comes_from_the_served_model(server: VllmServer) -> None:
    code, result, err = bench(server)
    assert code == 0, err
    assert result["errors"] == 0 and result["passes"][0]["ok"] == 6
    refusal = f"Token id {VOCAB} is out of vocabulary"
    assert result["token_range"] == {
        "low": 100, "high": VOCAB - 1, "largest_id": VOCAB - 1, "source": "server",
        "note": f"the server accepts id {VOCAB - 1} and refuses {VOCAB}: {refusal}",
    }  # fmt: skip
    assert result["failures"] == {"target": {"errors": 0, "by_status": {}, "first": []}}


def test_a_range_forced_beyond_the_vocabulary_reports_vllms_refusals(server: VllmServer) -> None:
    code, result, err = bench(server, "--vocab-size", "8000")
    assert code == 1
    assert result["token_range"]["source"] == "--vocab-size" and result["token_range"]["high"] == 7999
    (p,) = result["passes"]
    assert (p["errors"], p["errors_by_status"]) == (6, {"400": 6})
    target = result["failures"]["target"]
    assert target["errors"] == 6 and target["by_status"] == {"400": 6} and len(target["first"]) == 5
    for f in target["first"]:
        # vLLM answers a refused streaming request with HTTP 200 and one error event (code 400).
        assert (f["pass"], f["kind"], f["status"], f["in_stream"]) == ("measured", "400", 400, True)
        token = re.fullmatch(r"Token id (\d+) is out of vocabulary", f["message"])
        assert token is not None and VOCAB <= int(token[1]) <= 7999, f["message"]
    assert "target: 6 requests failed (400 x6); the first 5:" in err
    assert "HTTP 400 (in the stream): Token id " in err
