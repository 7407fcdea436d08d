from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import VLLM_PYTHON, build_model


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    if not VLLM_PYTHON.exists():
        pytest.fail("the e2e suite needs .venv-vllm: run tests/e2e/setup_vllm.sh (tests/run.sh does)")
    return build_model(tmp_path_factory.mktemp("model") / "llama-8x1024")
