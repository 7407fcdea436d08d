"""QuotaRegistry: quota CRUD that survives a restart, kept in `<data_dir>/quotas.json`.

Role: every change is written to the file first (engine/state_file.py: temp file, fsync, rename,
fsync of the directory, in the executor given at start-up, never on the loop), then applied to the
TenantLedger, so a change that was answered is both durable and in effect for the next operation; a
change whose write failed is not applied. Writers are serialized (the file's lock around
write-then-apply: the only lock, ordering file writes; readers never wait, they read the ledger).

State: the StateFile (path None: in memory only, as in unit tests), the ledger.

Primitives in call order:
  load(path)             at start-up: quotas from the file (none if absent); ConfigError naming the
                         file when it cannot be read or is not a valid quota file
  put(salt, quota)       create or replace
  delete(salt)           NotFound when the tenant has no quota

File format: {"version": 1, "quotas": {"<cache_salt>": {"l1_bytes": int|null, "l2_bytes": int|null,
"pinned_bytes": int|null}}} (pinned_bytes may be missing: null)
"""

from __future__ import annotations

import json
from concurrent.futures import Executor
from pathlib import Path

from app.errors import InvalidInput, NotFound
from engine.state_file import StateFile, render_json, write_atomically
from engine.tenants.ledger import TenantLedger
from engine.tenants.quota import Quota, check_salt

__all__ = ["FORMAT_VERSION", "QUOTA_FILE", "QuotaRegistry", "parse", "render", "write_atomically"]

QUOTA_FILE = "quotas.json"
FORMAT_VERSION = 1


class QuotaRegistry:
    def __init__(
        self, ledger: TenantLedger, path: Path | None = None, executor: Executor | None = None
    ) -> None:
        self.ledger = ledger
        self.path = path
        self._file = StateFile(path, executor, kind="quota", area="tenants")

    @staticmethod
    def load(path: Path) -> dict[str, Quota]:
        """Quotas saved in `path`; empty when the file does not exist. Blocking: start-up only."""
        return StateFile.load(path, parse, {}, kind="quota", area="tenants")

    async def put(self, salt: str, quota: Quota) -> None:
        check_salt(salt)
        async with self._file.writing:
            await self._save(self.ledger.quotas() | {salt: quota})
            self.ledger.set_quota(salt, quota)

    async def delete(self, salt: str) -> None:
        async with self._file.writing:
            quotas = self.ledger.quotas()
            if quotas.pop(salt, None) is None:
                raise NotFound(f"tenant {salt!r} has no quota")
            await self._save(quotas)
            self.ledger.drop_quota(salt)

    async def _save(self, quotas: dict[str, Quota]) -> None:
        await self._file.save(render(quotas))


def render(quotas: dict[str, Quota]) -> bytes:
    body = {"version": FORMAT_VERSION, "quotas": {s: q.to_json() for s, q in sorted(quotas.items())}}
    return render_json(body)


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
