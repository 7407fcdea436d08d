"""LoRA adapters on a real vLLM (CPU) with KVDepotConnector: an adapter never receives another
adapter's KV, nor the base model's, and hits its own.

Two random adapters (tests/e2e/make_lora.py, PEFT's format) change q/k/v/o of every layer, so the
same prompt tokens have different KV under each adapter and under the base model. vLLM hands the
scheduler side `request.lora_request` (lora_name, lora_int_id, lora_path); the chunk keys must
cover it, or the second adapter silently gets the first one's KV.

One reference vLLM without the connector (prefix caching on: its second answer to a prompt comes
from its own prefix cache, which keys blocks by adapter name and path) and one vLLM with the
connector (prefix caching off: every hit comes from kvdepot), both serving the same adapters.
A request that must miss is compared with the reference's full computation bit for bit; a request
that hits, with the reference's own prefix-cache hit (see test_vllm.py about exactness).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.sidecar import SidecarProcess, start_sidecar
from tests.e2e.harness import HITS, Tokens, VllmServer, build_lora, connector_config, prompt

pytestmark = pytest.mark.timeout(600)  # two vLLM starts side by side on a small machine

BLOCK = 128
PROMPT_TOKENS = 8 * BLOCK  # eight chunks of one block each
HIT = PROMPT_TOKENS - BLOCK  # sync loads: the last chunk is computed (the same as vLLM's own cache)
MAX_TOKENS = 8
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def lora_args(adapters: dict[str, Path], names: tuple[str, ...]) -> list[str]:
    modules = [f"{name}={adapters[name]}" for name in names]
    return ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", *modules]


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {name: build_lora(model_dir, root / name, seed) for name, seed in (("a", 1), ("b", 2), ("c", 3))}


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    sc = start_sidecar(tmp_path_factory.mktemp("sidecar"), env={"KVDEPOT_L1__CHUNK_SIZE": str(BLOCK)})
    yield sc
    sc.stop()


@pytest.fixture(scope="module")
def servers(
    model_dir: Path,
    adapters: dict[str, Path],
    sidecar: SidecarProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[VllmServer, VllmServer]]:
    """(reference, engine), started side by side. The engine serves a and b; c is loaded at run time."""
    logs = tmp_path_factory.mktemp("logs")
    kv = connector_config(sidecar.url, kvdepot_chunk_size=BLOCK, kvdepot_load="sync")
    started: list[VllmServer] = []
    try:
        started.append(
            VllmServer(
                model_dir, logs, prefix_caching=True, name="lora-reference",
                extra_args=lora_args(adapters, ("a", "b", "c")),
            )
        )  # fmt: skip
        started.append(
            VllmServer(
                model_dir, logs, kv=kv, name="lora-engine", extra_args=lora_args(adapters, ("a", "b")),
                extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
            )
        )  # fmt: skip
        for server in started:
            server.wait_healthy()
        yield started[0], started[1]
    finally:
        for server in started:
            server.stop()


def stored(sc: SidecarProcess) -> int:
    return int(sc.get_json("/status")["l1"]["counters"]["stored_chunks"])


def assert_close(got: Tokens, want: Tokens, tolerance: float = 0.05) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    assert all(abs(a - b) <= tolerance for (_, a), (_, b) in zip(got, want, strict=True))


def tokens(answer: Tokens) -> list[str]:
    return [t for t, _ in answer]


P = prompt(21, PROMPT_TOKENS)
REF: dict[str, Tokens] = {}


def complete(server: VllmServer, p: list[int], model: str | None = None) -> tuple[Tokens, int]:
    """The answer and the tokens it took from kvdepot (vllm:external_prefix_cache_hits_total)."""
    before = server.metric(HITS)
    got = server.complete(p, max_tokens=MAX_TOKENS, model=model)
    return got, int(server.metric(HITS) - before)


def test_adapter_b_never_receives_adapter_a_kv(
    servers: tuple[VllmServer, VllmServer], sidecar: SidecarProcess
) -> None:
    reference, engine = servers
    for name in ("a", "b"):
        REF[name] = reference.complete(P, max_tokens=MAX_TOKENS, model=name)
        REF[name + " cached"] = reference.complete(P, max_tokens=MAX_TOKENS, model=name)
    REF["base"] = reference.complete(P, max_tokens=MAX_TOKENS)
    # The adapters matter: otherwise receiving the wrong KV could not change an answer.
    assert len({tuple(tokens(REF[name])) for name in ("a", "b", "base")}) == 3, REF

    stored_before = stored(sidecar)
    a, hit = complete(engine, P, "a")
    assert hit == 0
    assert a == REF["a"]
    assert stored(sidecar) - stored_before == PROMPT_TOKENS // BLOCK  # A's chunks, saved in its step

    b, hit = complete(engine, P, "b")
    assert (hit, tokens(b)) == (0, tokens(REF["b"])), "adapter b was served adapter a's KV"
    assert b == REF["b"]


def test_base_model_never_receives_adapter_kv(servers: tuple[VllmServer, VllmServer]) -> None:
    _, engine = servers
    base, hit = complete(engine, P)
    assert (hit, tokens(base)) == (0, tokens(REF["base"])), "the base model was served an adapter's KV"
    assert base == REF["base"]


def test_each_adapter_hits_its_own_chunks(servers: tuple[VllmServer, VllmServer]) -> None:
    _, engine = servers
    for name in ("a", "b"):
        got, hit = complete(engine, P, name)
        assert hit == HIT, name
        assert got == REF[name + " cached"], f"{name}: KV from kvdepot must equal vLLM's own cached KV"
        assert_close(got, REF[name])


def write_adapter(src: Path, dst: Path) -> None:
    """Replaces the adapter files at dst with src's (fresh files: new mtimes, same sizes)."""
    dst.mkdir(exist_ok=True)
    for name in ADAPTER_FILES:
        (dst / name).unlink(missing_ok=True)
        shutil.copyfile(src / name, dst / name)


def load(engine: VllmServer, name: str, path: Path, *, in_place: bool = False) -> None:
    status, answer = engine.post(
        "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path), "load_inplace": in_place}
    )
    assert status == 200, answer


def test_adapter_reloaded_with_other_weights_never_receives_stale_kv(
    servers: tuple[VllmServer, VllmServer], adapters: dict[str, Path], tmp_path: Path
) -> None:
    """One name, one path, three sets of weights: reloaded in place (vLLM keeps its lora_int_id),
    then unloaded and loaded again (a new lora_int_id). Name and path alone would alias them."""
    reference, engine = servers
    p = prompt(22, PROMPT_TOKENS)
    want = {name: reference.complete(p, max_tokens=MAX_TOKENS, model=name) for name in ("a", "b", "c")}
    assert len({tuple(tokens(answer)) for answer in want.values()}) == 3, want
    path = tmp_path / "r"

    write_adapter(adapters["a"], path)
    load(engine, "r", path)
    got, hit = complete(engine, p, "r")
    assert (hit, got) == (0, want["a"])

    write_adapter(adapters["b"], path)
    load(engine, "r", path, in_place=True)
    got, hit = complete(engine, p, "r")
    assert (hit, tokens(got)) == (0, tokens(want["b"])), "reloaded in place: served the old weights' KV"
    assert got == want["b"]

    status, answer = engine.post("/v1/unload_lora_adapter", {"lora_name": "r"})
    assert status == 200, answer
    write_adapter(adapters["c"], path)
    load(engine, "r", path)
    got, hit = complete(engine, p, "r")
    assert (hit, tokens(got)) == (0, tokens(want["c"])), "unloaded and loaded: served the old weights' KV"
    assert got == want["c"]
