"""`kvdepot bench engine` end to end against fake OpenAI servers over real HTTP: what the servers
received, the JSON object, the CSV rows, the PNG, hits from /metrics, baselines and errors."""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.cli import main
from bench.engine.workloads import Options, build
from tests.unit.bench.engine.fake_openai import FakeServer, FakeState, answer_ids


@pytest.fixture(scope="module")
def default_server() -> Iterator[FakeServer]:
    """One fake server with the default state for the module (a uvicorn start and stop each cost
    a test about 0.25 s)."""
    with FakeServer(FakeState()) as s:
        yield s


@pytest.fixture
def server(default_server: FakeServer) -> FakeServer:
    """The module's fake server, its state (prompts, blocks, counters) as new."""
    default_server.state.reset()
    return default_server


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code, result, _ = run_cli_err(capsys, *argv)
    return code, result


def run_cli_err(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any], str]:
    """The exit status, the JSON object and what went to stderr."""
    code = main(["bench", "engine", "--quiet", *argv])
    captured = capsys.readouterr()
    out = captured.out.strip().splitlines()
    assert len(out) == 1, out  # ONE JSON object, nothing else
    return code, json.loads(out[0]), captured.err


def test_long_doc_qa_sends_the_workload_and_reports_every_output(
    server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    size = ["--documents", "3", "--document-tokens", "64", "--questions", "2", "--question-tokens", "4"]
    code, result = run_cli(
        capsys, "--url", server.url, "--workload", "long-doc-qa", *size, "--concurrency", "2",
        "--max-tokens", "3", "--seed", "5", "--json", str(tmp_path / "r.json"),
        "--csv", str(tmp_path / "r.csv"), "--plot", str(tmp_path / "r.png"),
    )  # fmt: skip
    assert code == 0
    # The server got the startup request, then exactly the workload's prompts (order may vary
    # within a pass at concurrency 2).
    expected = [
        [r.prompt for r in spec.requests]
        for spec in build(Options("long-doc-qa", seed=5, documents=3, document_tokens=64, questions=2,
                                  question_tokens=4, max_tokens=3)).passes()
    ]  # fmt: skip
    got = server.state.prompts[1:]
    assert sorted(got[:3]) == sorted(expected[0]) and sorted(got[3:]) == sorted(expected[1])
    assert all(
        b["stream"] and b["max_tokens"] == 3 and b["model"] == "fake-model" for b in server.state.bodies[1:]
    )

    assert json.loads((tmp_path / "r.json").read_text()) == result
    assert result["workload"] == "long-doc-qa" and result["concurrency"] == 2 and result["errors"] == 0
    # The server was asked whether it takes --token-high (plain, not streamed): it does.
    assert server.state.probes == [[7999]] and result["token_range"]["source"] == "default"
    assert result["failures"] == {"target": {"errors": 0, "by_status": {}, "first": []}}
    assert len(result["loadavg"]) == 2
    warm, measured = result["passes"]
    assert (warm["name"], warm["requests"]) == ("warmup", 3)
    assert (measured["name"], measured["requests"]) == ("measured", 6)
    for p in (warm, measured):
        assert p["ok"] == p["requests"] and p["output_tokens"] == 3 * p["requests"]
        assert 0 < p["ttft_ms"]["p50"] <= p["ttft_ms"]["p90"] <= p["ttft_ms"]["p99"] <= p["e2e_ms"]["p99"]
        assert p["itl_ms"]["p50"] > 0 and p["output_tokens_per_s"] > 0 and p["requests_per_s"] > 0
    # The fake caches 16-token blocks: warm-up hits nothing, measured hits the 64 document tokens.
    assert warm["hits"]["external_hit_tokens"] == 0 and warm["hits"]["external_query_tokens"] == 3 * 68
    hits = measured["hits"]
    assert hits["external_hit_tokens"] == 6 * 64
    assert hits["native_hit_rate"] == pytest.approx(64 / 68, abs=1e-4)
    assert measured["hits"]["prompt_tokens_by_source"]["external_kv_transfer"] == 6 * 64
    assert result["measured"]["requests"] == 6

    rows = list(csv.DictReader((tmp_path / "r.csv").read_text().splitlines()))
    assert list(rows[0]) == [
        "server", "pass", "index", "group", "start_s", "ttft_ms", "e2e_ms", "itl_ms_mean", "prompt_tokens",
        "output_tokens", "error",
    ]  # fmt: skip
    assert len(rows) == 9 and {r["pass"] for r in rows} == {"warmup", "measured"}
    assert all(r["server"] == "target" and r["prompt_tokens"] == "68" and not r["error"] for r in rows)
    groups = sorted(r["group"] for r in rows if r["pass"] == "measured")
    assert groups == ["doc0", "doc0", "doc1", "doc1", "doc2", "doc2"]
    assert float(rows[0]["ttft_ms"]) <= float(rows[0]["e2e_ms"])
    png = (tmp_path / "r.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000 and result["plot"] == str(tmp_path / "r.png")


def test_baseline_runs_the_same_passes_and_gives_speedups(
    server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeServer(FakeState()) as base:
        code, result = run_cli(
            capsys, "--url", server.url, "--baseline-url", base.url, "--workload", "random-prefill",
            "--prompt-tokens", "32", "--requests", "5", "--max-tokens", "2", "--csv", str(tmp_path / "b.csv"),
            "--plot", str(tmp_path / "b.png"),
        )  # fmt: skip
    assert code == 0
    assert server.state.prompts[1:] == base.state.prompts[1:] and len(base.state.prompts) == 6
    (p,) = result["passes"]
    assert p["baseline"]["requests"] == 5 and p["baseline"]["ttft_ms"]["p50"] > 0
    speed = p["ttft_speedup_vs_baseline"]
    assert speed["p50"] == round(p["baseline"]["ttft_ms"]["p50"] / p["ttft_ms"]["p50"], 3)
    rows = list(csv.DictReader((tmp_path / "b.csv").read_text().splitlines()))
    assert sorted({r["server"] for r in rows}) == ["baseline", "target"] and len(rows) == 10
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("token_ids", [True, False], ids=["return_token_ids", "tokenize"])
def test_multi_round_chat_sends_back_the_generated_ids(
    token_ids: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeServer(FakeState(token_ids=token_ids)) as server:
        code, result = run_cli(
            capsys, "--url", server.url, "--workload", "multi-round-chat", "--users", "2", "--rounds", "3",
            "--system-tokens", "32", "--user-tokens", "4", "--max-tokens", "5", "--concurrency", "2",
        )  # fmt: skip
    assert code == 0
    assert result["answer_ids_source"] == ("return_token_ids" if token_ids else "tokenize")
    assert [p["name"] for p in result["passes"]] == ["round1", "round2", "round3"]
    prompts = server.state.prompts[1:]
    assert all(b.get("return_token_ids") for b in server.state.bodies[1:])
    by_len = sorted(prompts, key=len)
    system = by_len[0][:32]
    assert all(p[:32] == system for p in prompts)
    # Every later prompt = an earlier prompt + the answer the server generated for it + 4 new tokens.
    for p in prompts:
        if len(p) > 36:
            parents = [q for q in prompts if len(q) == len(p) - 9 and p[: len(q)] == q]
            assert len(parents) == 1
            assert p[len(parents[0]) : len(parents[0]) + 5] == answer_ids(parents[0], 5)
    assert sorted(len(p) for p in prompts) == [36, 36, 45, 45, 54, 54]
    assert result["passes"][1]["hits"]["external_hit_tokens"] == 2 * 32  # the 36-token prompt's 2 blocks


def test_prefix_suffix_tuner_sizes_its_pool_from_the_sidecar(
    server: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, result = run_cli(
        capsys, "--url", server.url, "--sidecar-url", server.url + "/sidecar",
        "--workload", "prefix-suffix-tuner", "--context-tokens", "300", "--suffix-tokens", "36",
        "--breaker-tokens", "8", "--pool-multiple", "1.05", "--requests", "12",
        "--reuse", "zipf:1.1", "--max-tokens", "1", "--concurrency", "4",
    )  # fmt: skip
    assert code == 0
    # /status: 64 KiB of L1 in 4 KiB chunks of 256 tokens = 4096 tokens; prefixes of 256 tokens.
    assert result["capacity_tokens"] == 4096 and result["pool_size"] == 17 and result["pool_tier"] == "l1"
    warm, measured = result["passes"]
    assert warm["requests"] == 17 and measured["requests"] == 12
    assert all(len(p) == 300 for p in server.state.prompts[1:])
    assert measured["hits"]["external_hit_tokens"] == 12 * 256
    side = measured["sidecar"]
    assert side["lookup_hit_chunks"] == 3.0 and side["l2_loads"] == {"disk": 5.0}
    assert "sidecar" in warm


def test_failures_are_counted_and_the_exit_status_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeServer(FakeState(fail_every=3)) as server:
        code, result, err = run_cli_err(
            capsys, "--url", server.url, "--workload", "random-prefill", "--prompt-tokens", "8",
            "--requests", "9", "--no-warmup", "--max-tokens", "1",
        )  # fmt: skip
    assert code == 1
    (p,) = result["passes"]
    assert (p["requests"], p["ok"], p["errors"]) == (9, 6, 3) and result["errors"] == 3
    assert p["errors_by_status"] == {"500": 3}
    target = result["failures"]["target"]
    assert target["errors"] == 3 and target["by_status"] == {"500": 3}
    assert [(f["status"], f["in_stream"], f["message"]) for f in target["first"]] == [
        (500, False, "injected failure")
    ] * 3
    assert sorted(f["index"] for f in target["first"]) == [2, 5, 8]
    assert "target: 3 requests failed (500 x3)" in err and "HTTP 500: injected failure" in err


def test_a_timeout_is_named_by_its_exception(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeServer(FakeState(token_delay_s=1.0)) as server:
        code, result, err = run_cli_err(
            capsys, "--url", server.url, "--workload", "random-prefill", "--prompt-tokens", "8",
            "--requests", "2", "--no-warmup", "--max-tokens", "1", "--timeout", "0.2",
        )  # fmt: skip
    assert code == 1
    target = result["failures"]["target"]
    assert target["by_status"] == {"ReadTimeout": 2}
    assert all(f["kind"] == "ReadTimeout" and f["status"] is None for f in target["first"])
    assert "ReadTimeout" in err


def test_the_token_range_comes_from_the_servers(capsys: pytest.CaptureFixture[str]) -> None:
    # vLLM reports no vocabulary; it refuses ids beyond it. The baseline's is the smaller here.
    with FakeServer(FakeState(vocab_size=500)) as server, FakeServer(FakeState(vocab_size=300)) as base:
        code, result = run_cli(
            capsys, "--url", server.url, "--baseline-url", base.url, "--workload", "random-prefill",
            "--prompt-tokens", "200", "--requests", "3", "--max-tokens", "1",
        )  # fmt: skip
    assert code == 0 and result["errors"] == 0
    assert result["token_range"] == {
        "low": 100, "high": 299, "largest_id": 299, "source": "server",
        "note": "the server accepts id 299 and refuses 300: Token id 300 is out of vocabulary",
    }  # fmt: skip
    for state in (server.state, base.state):
        ids = [t for p in state.prompts[1:] for t in p]
        assert len(ids) == 600 and max(ids) == 299 and min(ids) == 100
        assert state.probes  # each server was asked
    assert result["failures"] == {
        name: {"errors": 0, "by_status": {}, "first": []} for name in ("target", "baseline")
    }


def test_a_range_forced_beyond_the_vocabulary_reports_the_servers_refusals(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with FakeServer(FakeState(vocab_size=300)) as server:
        code, result, err = run_cli_err(
            capsys, "--url", server.url, "--workload", "random-prefill", "--prompt-tokens", "200",
            "--requests", "7", "--max-tokens", "1", "--vocab-size", "8000",
        )  # fmt: skip
    assert code == 1 and server.state.probes == []  # --vocab-size: the server is not asked
    assert result["token_range"]["source"] == "--vocab-size" and result["token_range"]["high"] == 7999
    target = result["failures"]["target"]
    assert target["errors"] == 7 and target["by_status"] == {"400": 7} and len(target["first"]) == 5
    for f in target["first"]:
        assert (f["kind"], f["status"], f["in_stream"]) == ("400", 400, True)
        assert re.fullmatch(r"Token id \d+ is out of vocabulary", f["message"])
    assert "target: 7 requests failed (400 x7); the first 5:" in err
    assert "HTTP 400 (in the stream): Token id" in err


def test_duration_bounds_a_pooled_pass(server: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    code, result = run_cli(
        capsys, "--url", server.url, "--workload", "shared-system-prompt", "--system-tokens", "32",
        "--question-tokens", "4", "--duration", "0.6", "--max-tokens", "1", "--qps", "40",
    )  # fmt: skip
    assert code == 0
    warm, measured = result["passes"]
    assert warm["requests"] == 1 and 2 <= measured["requests"] <= 60
    assert result["qps"] == 40.0 and result["concurrency"] is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "random-prefill", "--reuse", "zipf:0"], "--reuse"),
        (["--workload", "prefix-suffix-tuner"], "pool-size"),
        (["--workload", "long-doc-qa", "--concurrency", "0"], "--concurrency"),
        (["--workload", "long-doc-qa", "--documents", "0"], "--documents"),
        (["--workload", "random-prefill", "--qps", "-1"], "--qps"),
    ],
)
def test_bad_options_exit_2_before_any_request(
    server: FakeServer, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "engine", "--quiet", "--url", server.url, *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""
    assert server.state.prompts == []


def test_unreachable_server_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.ports import free_port

    code = main(["bench", "engine", "--quiet", "--url", f"http://127.0.0.1:{free_port()}",
                 "--workload", "random-prefill", "--requests", "1"])  # fmt: skip
    assert code == 1
    assert "ConnectError" in capsys.readouterr().err


def test_vocabulary_from_the_model_folder_bounds_the_ids(
    server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300}))
    code, result = run_cli(
        capsys, "--url", server.url, "--workload", "random-prefill", "--prompt-tokens", "200",
        "--requests", "3", "--max-tokens", "1", "--tokenizer", str(tmp_path), "--no-warmup",
    )  # fmt: skip
    assert code == 0 and server.state.probes == []
    assert result["token_range"] == {
        "low": 100, "high": 299, "largest_id": 299, "source": "--tokenizer",
        "note": f"vocab_size 300 in {tmp_path / 'config.json'}",
    }  # fmt: skip
    ids = [t for p in server.state.prompts for t in p]
    assert len(ids) == 600 and max(ids) == 299 and min(ids) == 100
    assert main(["bench", "engine", "--quiet", "--url", server.url, "--workload", "random-prefill",
                 "--tokenizer", str(tmp_path / "missing")]) == 2  # fmt: skip
    assert "vocab_size" in capsys.readouterr().err
