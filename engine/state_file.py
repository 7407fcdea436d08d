"""StateFile: one small JSON file of the sidecar's state in its data dir (quotas.json, labels.json,
pins.json, purges.json), read at start-up and rewritten whole, atomically, on every change.

Role: the skeleton the components that persist state share. At start-up `load` reads the file
(absent: the empty state) and hands its text to the component's parser; a file that cannot be read,
or that the parser refuses (ValueError, InvalidInput), is a ConfigError naming it. On each change
the component renders its whole new state (`render_json`) and `save`s it before applying it, so a
change that was answered is durable, and one whose write failed (BackendError) is not applied.
Writes run in the executor given at start-up, never on the loop (`write_atomically`: temp file in
the same directory, fsync, rename over, fsync of the directory: a crash leaves the old file or the
new one, never a mix). Writers hold `writing` (an asyncio.Lock: the only lock, ordering
write-then-apply; readers read the component's state and never wait).

State: the path (None: in memory only, as in unit tests: nothing is written), the executor, the
writer lock. Event loop (the writes: the executor's thread).

Primitives in call order:
  StateFile.load(path, parse, empty, kind=, area=)   start-up (blocking): the parsed state
  StateFile(path, executor, kind=, area=)            the component's file
  async with file.writing: await file.save(data)     BackendError "<kind>s not changed" on failure
  await file.write(data)                             the same, the OSError left to the caller
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import TypeVar

from app.errors import BackendError, ConfigError, InvalidInput

T = TypeVar("T")


class StateFile:
    def __init__(self, path: Path | None, executor: Executor | None, *, kind: str, area: str) -> None:
        """`kind`: what the file holds, singular ("quota"); `area`: the settings area its
        ConfigErrors name ("tenants")."""
        if path is not None and executor is None:
            raise ValueError(f"a persistent {kind} file needs an executor for its writes")
        self.path = path
        self.kind = kind
        self.area = area
        self._executor = executor
        self.writing = asyncio.Lock()

    @staticmethod
    def load(path: Path | None, parse: Callable[[str], T], empty: T, *, kind: str, area: str) -> T:
        """The state saved in `path`, as `parse` reads its text; `empty` when there is no file.
        Blocking: start-up only. ConfigError naming the file when it cannot be read or `parse`
        raises ValueError or InvalidInput."""
        if path is None:
            return empty
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return empty
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{area}: cannot read the {kind} file {path}: {exc}") from None
        try:
            return parse(text)
        except (ValueError, InvalidInput) as exc:
            raise ConfigError(
                f"{area}: the {kind} file {path} is not valid ({exc}); fix it or move it away"
            ) from None

    async def save(self, data: bytes) -> None:
        """Replace the file with `data` (nothing without a path); BackendError when it cannot be
        written (the caller applies nothing then)."""
        try:
            await self.write(data)
        except OSError as exc:
            raise BackendError(
                f"{self.kind}s not changed: cannot write {self.path}: {exc.strerror or exc}"
            ) from None

    async def write(self, data: bytes) -> None:
        """Replace the file with `data` in the executor (nothing without a path); OSError raised."""
        if self.path is None:
            return
        await asyncio.get_running_loop().run_in_executor(self._executor, write_atomically, self.path, data)


def render_json(body: object) -> bytes:
    """A state file's text: JSON, one space of indent, UTF-8, a final newline."""
    return (json.dumps(body, indent=1, ensure_ascii=False) + "\n").encode()


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a crash leaves the old file or the new one, never a mix.
    In the executor: temp file in the same directory, fsync, rename over, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
