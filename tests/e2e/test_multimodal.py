"""A real vLLM serving the tiny random image+text model (make_mm_model.py) through the chat API.

Without a connector, this pins down what the multimodal e2e tests build on: the model must read
its images (two images behind the same placeholder tokens give other greedy tokens), or a test that
hands one image's KV to another image's request could never fail; and the same image must give the
same answer. With the connector: a request never gets the KV of another image behind the same tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.sidecar import SidecarProcess, start_sidecar
from tests.e2e.harness import (
    HITS,
    Tokens,
    VllmServer,
    build_mm_model,
    connector_config,
    image_part,
    need_vllm,
    text_part,
)

BLOCK = 128

# About 330 tokens of chat text: an image after it starts at token 333, in the third 128-token chunk.
LONG_TEXT = "def f(x):\n    return x + 1\n" * 30
IMAGE_PLACEHOLDER = 67  # <fake_token_around_image> <global-img> 64 x <image> <fake_token_around_image>


@pytest.fixture(scope="module")
def mm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    need_vllm()
    return build_mm_model(tmp_path_factory.mktemp("mm-model") / "idefics3-tiny")


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    sc = start_sidecar(tmp_path_factory.mktemp("sidecar"), env={"KVDEPOT_L1__CHUNK_SIZE": str(BLOCK)})
    yield sc
    sc.stop()


@pytest.fixture(scope="module")
def both(mm_model_dir: Path, logs: Path, sidecar: SidecarProcess) -> Iterator[tuple[VllmServer, VllmServer]]:
    """The plain server and the one with the connector, started side by side (each one's first
    request waits for its start)."""
    kv = connector_config(sidecar.url, kvdepot_chunk_size=BLOCK, kvdepot_load="sync")
    started: list[VllmServer] = []
    try:
        started.append(VllmServer(mm_model_dir, logs, name="mm"))
        started.append(VllmServer(mm_model_dir, logs, kv=kv, name="mm-engine"))
        yield started[0], started[1]
    finally:
        for srv in started:
            srv.stop()


@pytest.fixture(scope="module")
def server(both: tuple[VllmServer, VllmServer]) -> VllmServer:
    return both[0]


@pytest.fixture(scope="module")
def engine(both: tuple[VllmServer, VllmServer]) -> VllmServer:
    return both[1]


def wait_l1_objects(sc: SidecarProcess, at_least: int) -> None:
    deadline = time.monotonic() + 60
    while sc.get_json("/status")["l1"]["objects"] < at_least:
        assert time.monotonic() < deadline, "the chunks were not stored"
        time.sleep(0.1)


def after_long_text(seed: int) -> list[dict[str, object]]:
    """About 412 tokens; the image's placeholder is at 333..399, inside the third 128-token chunk."""
    return [text_part(LONG_TEXT), image_part(seed), text_part("Describe it.")]


@pytest.mark.parametrize("where", ["first", "after_long_text"])
def test_the_answer_depends_on_the_image_and_only_on_it(server: VllmServer, where: str) -> None:
    def content(seed: int) -> list[dict[str, object]]:
        if where == "first":
            return [image_part(seed), text_part(LONG_TEXT)]
        return [text_part(LONG_TEXT), image_part(seed), text_part("Describe it.")]

    a, a_len = server.chat(content(1), max_tokens=8)
    b, b_len = server.chat(content(2), max_tokens=8)
    a_again, _ = server.chat(content(1), max_tokens=8)

    assert a_len == b_len
    if where == "first":
        _, text_len = server.chat([text_part(LONG_TEXT)], max_tokens=1)
        assert a_len == text_len + IMAGE_PLACEHOLDER
    assert [t for t, _ in a] != [t for t, _ in b]
    assert a_again == a


def assert_close(got: Tokens, want: Tokens, tolerance: float = 0.05) -> None:
    """Same tokens, logprobs within `tolerance` (reusing KV moves them in the third decimal; the KV
    of another image moved the first logprob by 0.2)."""
    assert [t for t, _ in got] == [t for t, _ in want]
    assert all(abs(a - b) <= tolerance for (_, a), (_, b) in zip(got, want, strict=True)), (got, want)


def test_another_image_behind_the_same_tokens_gets_no_hit(
    server: VllmServer, engine: VllmServer, sidecar: SidecarProcess
) -> None:
    want_a, _ = server.chat(after_long_text(1), max_tokens=8)
    want_b, _ = server.chat(after_long_text(2), max_tokens=8)
    engine.chat(after_long_text(1), max_tokens=8)  # stores the 3 full chunks of image 1's prompt
    wait_l1_objects(sidecar, 3)

    hits_before = engine.metric(HITS)
    got_b, _ = engine.chat(after_long_text(2), max_tokens=8)
    hits = engine.metric(HITS) - hits_before
    # Exactly the two chunks before the image (text only) are shared; none from the image on.
    assert hits == 2 * BLOCK, f"image 2 hit {hits:.0f} tokens: image 1's KV, or not even the text before it"
    assert_close(got_b, want_b)

    hits_before = engine.metric(HITS)
    got_a, _ = engine.chat(after_long_text(1), max_tokens=8)
    assert engine.metric(HITS) - hits_before == 3 * BLOCK  # the same image hits all 3 full chunks
    assert_close(got_a, want_a)
