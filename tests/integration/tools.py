"""Debian tools some integration tests drive (prometheus, promtool, chromium), and the venvs of
other projects they run (vLLM's, Dynamo's: `need_python`).

tests/run.sh installs them and sets TESTS_NEED_TOOLS=1: under it a missing tool fails the
test, so the README's test command never passes by skipping. A bare `pytest` elsewhere skips.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: vLLM's venv beside this checkout (tests/e2e/setup_vllm.sh makes it; tests/run.sh runs it before
#: the integration and e2e suites); KVDEPOT_VLLM_PYTHON names another interpreter.
VLLM_PYTHON = Path(os.environ.get("KVDEPOT_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python")))
#: NVIDIA Dynamo's venv beside this checkout (tests/integration/setup_dynamo.sh makes it).
DYNAMO_PYTHON = ROOT / ".venv-dynamo" / "bin" / "python"


def need_tool(name: str, package: str) -> str:
    """The path of `name`; a skip (bare pytest) or a failure (tests/run.sh) when it is missing."""
    path = shutil.which(name)
    if path is not None:
        return path
    why = f"{name} is not installed (Debian's {package} package; tests/run.sh sets it up)"
    if os.environ.get("TESTS_NEED_TOOLS") == "1":
        pytest.fail(why)
    pytest.skip(why)


def need_python(python: Path, made_by: str) -> Path:
    """`python` (a venv's interpreter); a skip (bare pytest) or a failure (tests/run.sh, which
    runs `made_by` first) when it is missing."""
    if python.exists():
        return python
    why = f"no venv at {python} ({made_by} makes it)"
    if os.environ.get("TESTS_NEED_TOOLS") == "1":
        pytest.fail(why)
    pytest.skip(why)
