"""A three-turn chat through a real vLLM (CPU) with KVDepotConnector: every turn's prompt is the
previous prompt, the previous answer's token ids and new tokens, so turns 2 and 3 hit through the
full chunks of the previous answers, which the connector saved when those requests finished
(kvdepot_save_decode, on by default).

The reference is the same chat on a plain vLLM without the connector (prefix caching on): its
own prefix cache keeps the blocks of generated tokens too, so it reuses exactly what the
connector does (chunks of one block) and the tokens and logprobs must match it (within the
tolerance of test_vllm.py; measured: bit for bit). Turn 1 must also equal a full computation (the
same prompt under a fresh cache_salt). Turns 2 and 3 are not compared with one: KV computed while
decoding differs in the last bits from the same tokens' KV computed in a prefill, and this random
model's logits are nearly flat, so the greedy token flips at a near-tie (measured: two candidates
4e-6 apart in logprob) for vLLM's own prefix cache exactly as for the connector.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.bench.sidecar import SidecarProcess, start_sidecar
from tests.e2e.harness import HITS, VllmServer, connector_config, prompt
from tests.e2e.test_vllm import BLOCK, assert_close

ANSWER = 160  # tokens per answer: more than a full chunk of 128
NEW = 40  # new tokens of the user in every later turn


def decode_chunks_stored(sc: SidecarProcess) -> int:
    with urllib.request.urlopen(sc.http + "/metrics", timeout=5) as answer:
        text = answer.read().decode()
    found = re.search(r"^kvdepot_decode_chunks_stored_total (\S+)$", text, re.MULTILINE)
    assert found
    return int(float(found.group(1)))


def wait_decode_chunks(sc: SidecarProcess, expected: int) -> None:
    """The decode save runs in the engine step after the request finished: wait for it."""
    deadline = time.monotonic() + 60
    while decode_chunks_stored(sc) < expected:
        assert time.monotonic() < deadline, f"{decode_chunks_stored(sc)} decode chunks stored, not {expected}"
        time.sleep(0.1)
    assert decode_chunks_stored(sc) == expected


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    sc = start_sidecar(tmp_path_factory.mktemp("sidecar"), env={"KVDEPOT_L1__CHUNK_SIZE": str(BLOCK)})
    yield sc
    sc.stop()


@pytest.fixture(scope="module")
def engine(model_dir: Path, logs: Path, sidecar: SidecarProcess) -> Iterator[VllmServer]:
    kv = connector_config(sidecar.url, kvdepot_chunk_size=BLOCK, kvdepot_load="sync")
    server = VllmServer(model_dir, logs, kv=kv, name="engine-chat").wait_healthy()
    yield server
    server.stop()


@pytest.mark.timeout(1200)  # nine answers of 160 tokens on two shared cores
def test_three_turns_hit_through_the_previous_answers(
    reference: VllmServer, sidecar: SidecarProcess, engine: VllmServer
) -> None:
    turn_prompt = prompt(21, 1000)  # 7 full chunks and 104 tokens
    # Full chunks of prompt + answer with KV when each turn ends (the last answer token has none),
    # and the hit each turn must get: every full chunk stored by the turns before.
    expected_hits = [0]
    expected_decode = 0
    for turn in range(3):
        hits_before = engine.metric(HITS)
        got, answer = engine.complete_ids(turn_prompt, max_tokens=ANSWER)
        assert engine.metric(HITS) - hits_before == expected_hits[turn], f"turn {turn + 1}"

        if turn == 0:  # no reuse yet: exactly a full computation
            assert got == reference.complete(turn_prompt, max_tokens=ANSWER, cache_salt="full")
        assert_close(got, reference.complete(turn_prompt, max_tokens=ANSWER))

        # The decode save: the chunks past the ones the prompt filled, up to the last with KV.
        prompt_chunks = len(turn_prompt) // BLOCK
        done_chunks = (len(turn_prompt) + ANSWER - 1) // BLOCK
        expected_decode += done_chunks - prompt_chunks
        wait_decode_chunks(sidecar, expected_decode)

        turn_prompt = turn_prompt + answer + prompt(100 + turn, NEW)
        expected_hits.append(done_chunks * BLOCK)
    assert expected_hits[1:3] == [1152, 1280]  # turn 2 and 3: through the answers' full chunks
