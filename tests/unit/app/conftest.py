from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _no_kvdepot_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings read KVDEPOT_* variables: start every test from an environment without any."""
    for name in list(os.environ):
        if name.upper().startswith("KVDEPOT_"):
            monkeypatch.delenv(name)

