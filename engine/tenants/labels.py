"""LabelRegistry: tenants' display names, kept in `<data_dir>/labels.json` like quotas.

Role: a tenant is named by its cache_salt, a secret. `PUT /tenants/{cache_salt}/label` gives it a
display name that metrics (the `tenant` label), /status, purge jobs and logs use instead of the
salt. Every change is written to the file first (engine/state_file.py: temp file, fsync, rename, in
the executor given), then applied to the TenantLedger; writers are serialized by the file's lock
(readers read the ledger).

A label is 1..64 characters of [A-Za-z0-9_.:-], starting with a letter or digit, never `other` or
`_default` (the metrics' reserved names), unique among labels, and not the salt of another tenant
the ledger knows, labelled or not (a quota or bytes held; 409 otherwise: a label is shown where the
salt is hidden, so it must never spell another tenant's salt). Best effort: a salt first seen later
may still be spelled like a label.

State: the StateFile (path None: in memory only), the ledger. Event loop.

Primitives in call order: load(path) (start-up), put(salt, label), delete(salt) (NotFound without
a label).

File format: {"version": 1, "labels": {"<cache_salt>": "<label>"}}
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Executor
from pathlib import Path

from app.errors import Conflict, InvalidInput, NotFound
from engine.state_file import StateFile, render_json
from engine.tenants.ledger import UNNAMEABLE, TenantLedger
from engine.tenants.quota import check_salt, display_name

LABEL_FILE = "labels.json"
FORMAT_VERSION = 1
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")


def check_label(label: object) -> str:
    if not isinstance(label, str) or not LABEL.fullmatch(label):
        raise InvalidInput(
            "label must be 1..64 characters of A-Z a-z 0-9 _ . : - starting with a letter or digit"
        )
    if label in UNNAMEABLE:
        raise InvalidInput(f"label {label!r} is reserved")
    return label


class LabelRegistry:
    def __init__(
        self, ledger: TenantLedger, path: Path | None = None, executor: Executor | None = None
    ) -> None:
        self.ledger = ledger
        self.path = path
        self._file = StateFile(path, executor, kind="label", area="tenants")

    @staticmethod
    def load(path: Path) -> dict[str, str]:
        """Labels saved in `path`; empty when the file does not exist. Blocking: start-up only."""
        return StateFile.load(path, parse, {}, kind="label", area="tenants")

    async def put(self, salt: str, label: object) -> None:
        check_salt(salt)
        name = check_label(label)
        async with self._file.writing:
            labels = self.ledger.labels()
            taken = next((s for s, v in labels.items() if v == name and s != salt), None)
            if taken is not None:
                raise Conflict(f"label {name!r} names another tenant")
            if name != salt and name in {display_name(s) for s in self.ledger.tenants()}:
                # labelled or not: a label is shown where salts are hidden, never another's salt
                raise Conflict(f"label {name!r} is spelled like another tenant's cache_salt")
            await self._save(labels | {salt: name})
            self.ledger.set_label(salt, name)

    async def delete(self, salt: str) -> None:
        async with self._file.writing:
            labels = self.ledger.labels()
            if labels.pop(salt, None) is None:
                raise NotFound("this tenant has no label")
            await self._save(labels)
            self.ledger.drop_label(salt)

    async def _save(self, labels: dict[str, str]) -> None:
        body = {"version": FORMAT_VERSION, "labels": dict(sorted(labels.items()))}
        await self._file.save(render_json(body))


def parse(text: str) -> dict[str, str]:
    """The labels in a label file's text. ValueError or InvalidInput saying what is wrong."""
    body = json.loads(text)
    if not isinstance(body, dict) or body.get("version") != FORMAT_VERSION:
        raise ValueError(f'expected {{"version": {FORMAT_VERSION}, "labels": {{...}}}}')
    labels = body.get("labels")
    if not isinstance(labels, dict):
        raise ValueError('"labels" must be an object of cache_salt -> label')
    return {check_salt(str(s)): check_label(v) for s, v in labels.items()}
