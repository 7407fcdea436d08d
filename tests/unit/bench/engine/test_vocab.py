"""The token range: from the options, or asked of a server (a fake one over real HTTP that refuses
out-of-vocabulary ids the way vLLM does)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from bench.engine.vocab import TokenRange, from_options, narrowest, probe
from bench.engine.workloads import WorkloadError
from tests.unit.bench.engine.fake_openai import FakeServer, FakeState


def test_the_options_state_the_range(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300}))
    assert from_options(None, None) is None
    assert from_options(500, tmp_path) == TokenRange(499, "--vocab-size", "--vocab-size 500")
    got = from_options(None, tmp_path)
    assert got is not None and (got.largest_id, got.source) == (299, "--tokenizer")
    assert str(tmp_path / "config.json") in got.note
    with pytest.raises(WorkloadError, match="vocab_size"):
        from_options(None, tmp_path / "missing")


def ask(url: str, token_high: int) -> TokenRange:
    async def go() -> TokenRange:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            return await probe(client, "fake-model", token_high)

    return asyncio.run(go())


@pytest.mark.parametrize("vocab", [1, 2, 300, 4096, 7999])
def test_bisection_finds_the_largest_accepted_id(vocab: int) -> None:
    with FakeServer(FakeState(vocab_size=vocab)) as server:
        got = ask(server.url, 7999)
    assert (got.largest_id, got.source) == (vocab - 1, "server")
    assert (
        got.note
        == f"the server accepts id {vocab - 1} and refuses {vocab}: Token id {vocab} is out of vocabulary"
    )
    assert len(server.state.probes) <= 14 and server.state.prompts == []  # log2(8000) + 1, none streamed


def test_a_server_that_accepts_the_high_id_leaves_the_defaults() -> None:
    with FakeServer(FakeState(vocab_size=8000)) as server:
        got = ask(server.url, 7999)
    assert got == TokenRange(None, "default", "the server accepts id 7999 (--token-high)")
    assert server.state.probes == [[7999]]


def test_answers_that_say_nothing_of_a_vocabulary_leave_the_defaults() -> None:
    with FakeServer(FakeState(vocab_size=0)) as server:
        refuses_all = ask(server.url, 7999)
        not_found = ask(server.url + "/nothing", 7999)
    assert (refuses_all.largest_id, refuses_all.source) == (None, "default")
    assert refuses_all.note.startswith("the server refuses every id, 0 too: Token id 0 is out of vocabulary")
    assert (not_found.largest_id, not_found.source) == (None, "default")
    assert "id 7999: HTTP 404" in not_found.note


def test_the_narrowest_range_of_target_and_baseline_wins() -> None:
    default = TokenRange(None, "default", "accepts")
    small, large = TokenRange(299, "server", "a"), TokenRange(499, "server", "b")
    assert narrowest([default, large, small]) == small
    assert narrowest([default]) == default
