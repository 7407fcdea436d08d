"""QuotaRegistry: quota CRUD that survives a restart, kept in `<data_dir>/quotas.json`.

Role: every change is written to the file first (temp file, fsync, rename, fsync of the directory,
in the executor given at start-up, never on the loop), then applied to the TenantLedger, so a change
that was answered is both durable and in effect for the next operation; a change whose write failed
is not applied. Writers are serialized (an asyncio.Lock around write-then-apply: the only lock,
ordering file writes; readers never wait, they read the ledger).

State: the file path (None: in memory only, as in unit tests), the executor, the writer lock.

Primitives in call order:
  load(path)             at start-up: quotas from the file (none if absent); ConfigError naming the
                         file when it cannot be read or is not a valid quota file
  put(salt, quota)       create or replace
  delete(salt)           NotFound when the tenant has no quota

File format: {"version": 1, "quotas": {"<cache_salt>": {"l1_bytes": int|null, "l2_bytes": int|null,
"pinned_bytes": int|null}}} (pinned_bytes may be missing: null)
"""

from __future__ import annotations

import asyncio
import json
import os
from concurrent.futures import Executor
from pathlib import Path

from app.errors import BackendError, ConfigError, InvalidInput, NotFound
from engine.tenants.ledger import TenantLedger
from engine.tenants.quota import Quota, check_salt

QUOTA_FILE = "quotas.json"
FORMAT_VERSION = 1


class QuotaRegistry:
    def __init__(
        self, ledger: TenantLedger, path: Path | None = None, executor: Executor | None = None
    ) -> None:
        if path is not None and executor is None:
            raise ValueError("a persistent registry needs an executor for its file writes")
        self.ledger = ledger
        self.path = path
        self._executor = executor
        self._writing = asyncio.Lock()

    @staticmethod
    def load(path: Path) -> dict[str, Quota]:
        """Quotas saved in `path`; empty when the file does not exist. Blocking: start-up only."""
        text = read_state_file(path, "quota")
        if text is None:
            return {}
        try:
            return parse(text)
        except (ValueError, InvalidInput) as exc:
            raise ConfigError(
                f"tenants: the quota file {path} is not valid ({exc}); fix it or move it away"
            ) from None

    async def put(self, salt: str, quota: Quota) -> None:
        check_salt(salt)
        async with self._writing:
            await self._save(self.ledger.quotas() | {salt: quota})
            self.ledger.set_quota(salt, quota)

    async def delete(self, salt: str) -> None:
        async with self._writing:
            quotas = self.ledger.quotas()
            if quotas.pop(salt, None) is None:
                raise NotFound(f"tenant {salt!r} has no quota")
            await self._save(quotas)
            self.ledger.drop_quota(salt)

    async def _save(self, quotas: dict[str, Quota]) -> None:
        if self.path is None:
            return
        await save_state_file(self._executor, self.path, render(quotas), "quotas")


def render(quotas: dict[str, Quota]) -> bytes:
    body = {"version": FORMAT_VERSION, "quotas": {s: q.to_json() for s, q in sorted(quotas.items())}}
    return (json.dumps(body, indent=1, ensure_ascii=False) + "\n").encode()


def parse(text: str) -> dict[str, Quota]:
    """The quotas in a quota file's text. ValueError or InvalidInput saying what is wrong."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(body, dict) or set(body) != {"version", "quotas"}:
        raise ValueError('expected an object {"version": 1, "quotas": {...}}')
    if body["version"] != FORMAT_VERSION:
        raise ValueError(f"unsupported version {body['version']!r} (this kvdepot reads {FORMAT_VERSION})")
    entries = body["quotas"]
    if not isinstance(entries, dict):
        raise ValueError('"quotas" must be an object of cache_salt -> quota')
    out: dict[str, Quota] = {}
    for salt, entry in entries.items():
        try:
            out[check_salt(salt)] = Quota.from_json(entry)
        except InvalidInput as exc:
            raise ValueError(f"tenant {salt[:64]!r}: {exc}") from None
    return out


def read_state_file(path: Path, kind: str) -> str | None:
    """The text of a tenants' state file (quotas, labels); None when it does not exist. Blocking:
    start-up only. An unreadable file is a ConfigError naming it."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"tenants: cannot read the {kind} file {path}: {exc}") from None


async def save_state_file(executor: Executor | None, path: Path, data: bytes, what: str) -> None:
    """`write_atomically` in `executor`; a failed write is a BackendError saying `what` did not change."""
    loop = asyncio.get_running_loop()
    try:
        await loop.run_in_executor(executor, write_atomically, path, data)
    except OSError as exc:
        raise BackendError(f"{what} not changed: cannot write {path}: {exc.strerror or exc}") from None


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
