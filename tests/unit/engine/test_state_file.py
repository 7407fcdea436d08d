"""StateFile: a state file read at start-up (absent: empty; unreadable or refused: a ConfigError
naming it), rewritten whole and atomically, a failed write a BackendError that leaves the old file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from app.errors import BackendError, ConfigError
from engine.state_file import StateFile, render_json

pytestmark = pytest.mark.anyio


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1, thread_name_prefix="test-state") as pool:
        yield pool


def parse(text: str) -> dict[str, int]:
    body = json.loads(text)
    if not isinstance(body, dict):
        raise ValueError("expected an object")
    return {str(k): int(v) for k, v in body.items()}


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


async def test_saved_state_is_read_back_and_nothing_else_stays(
    tmp_path: Path, executor: ThreadPoolExecutor
) -> None:
    path = tmp_path / "things.json"
    assert StateFile.load(path, parse, {}, kind="thing", area="things") == {}  # no file yet
    state = StateFile(path, executor, kind="thing", area="things")
    async with state.writing:
        await state.save(render_json({"a": 1}))
        await state.save(render_json({"a": 2, "b": 3}))
    assert StateFile.load(path, parse, {}, kind="thing", area="things") == {"a": 2, "b": 3}
    assert names(tmp_path) == ["things.json"]  # no temp file left


def test_a_bad_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "things.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"things: the thing file .*things\.json is not valid"):
        StateFile.load(path, parse, {}, kind="thing", area="things")
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="things: cannot read the thing file"):
        StateFile.load(path, parse, {}, kind="thing", area="things")


async def test_a_failed_write_keeps_the_old_file(tmp_path: Path, executor: ThreadPoolExecutor) -> None:
    path = tmp_path / "things.json"
    state = StateFile(path, executor, kind="thing", area="things")
    await state.save(render_json({"a": 1}))
    (tmp_path / "things.json.tmp").mkdir()  # the temp file cannot be opened
    with pytest.raises(BackendError, match="things not changed"):
        await state.save(render_json({"a": 2}))
    assert StateFile.load(path, parse, {}, kind="thing", area="things") == {"a": 1}


def test_a_file_without_an_executor_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="executor"):
        StateFile(tmp_path / "things.json", None, kind="thing", area="things")
    StateFile(None, None, kind="thing", area="things")  # in memory: nothing is written
