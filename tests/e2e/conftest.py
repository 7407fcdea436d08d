from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import VllmServer, build_model, need_vllm

# A real vLLM per test, often two or three side by side, on two cores: a 4096-token prefill takes
# seconds (float32; tens of seconds in bfloat16 on a CPU without AVX512-BF16), so the suite-wide
# 300 s would fail tests that are merely slow. A hang still fails, later.
E2E_TIMEOUT_S = 1800


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.slow)
            mark = item.get_closest_marker("timeout")
            if mark is None or (mark.args and mark.args[0] < E2E_TIMEOUT_S):
                item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S), append=False)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    need_vllm()
    return build_model(tmp_path_factory.mktemp("model") / "llama-8x1024")


@pytest.fixture(scope="session")
def reference(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """A plain vLLM (no connector, its own prefix cache on) whose answers are the references: one
    for the whole session (test_vllm.py, then test_vllm_multiturn.py), one engine start fewer. Its
    prefix cache holds what earlier tests sent; a test that needs a full computation sends a
    `cache_salt` no one else uses. Not waited for here: it starts while the module's own engine
    does, and its first request waits for it."""
    server = VllmServer(
        model_dir, tmp_path_factory.mktemp("reference-logs"), prefix_caching=True, name="reference"
    )
    yield server
    server.stop()
