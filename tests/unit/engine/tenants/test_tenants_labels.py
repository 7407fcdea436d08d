"""Tenant labels: written to labels.json before they apply, read back at start, checked (reserved
names, charset, length, taken, spelled like another tenant's salt), and used by the ledger in
place of the salt for metric labels, /status and descriptions; hits noted per tier."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from app.errors import ConfigError, Conflict, InvalidInput, NotFound
from engine.tenants.labels import LABEL_FILE, LabelRegistry
from engine.tenants.ledger import OTHER, TenantLedger
from engine.tenants.quota import L1, Quota

pytestmark = pytest.mark.anyio


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1, thread_name_prefix="test-state") as pool:
        yield pool


async def test_labels_persist_and_name_the_tenant(tmp_path: Path, executor: ThreadPoolExecutor) -> None:
    path = tmp_path / LABEL_FILE
    ledger = TenantLedger()
    ledger.charge("secret", L1, 100)
    ledger.charge("other", L1, 50)  # a salt spelled like the reserved label
    ledger.charge("plain", L1, 10)
    registry = LabelRegistry(ledger, path, executor)
    await registry.put("secret", "acme")
    await registry.put("other", "beta")
    assert json.loads(path.read_text()) == {"version": 1, "labels": {"other": "beta", "secret": "acme"}}
    assert LabelRegistry.load(path) == {"secret": "acme", "other": "beta"}
    named = ledger.labelled(top_n=5)
    assert set(named) == {"acme", "beta", "plain", OTHER}
    assert named["acme"][L1].bytes == 100 and named["beta"][L1].bytes == 50
    assert ledger.summary()["largest"][0]["tenant"] == "acme"
    ledger.set_quota("secret", Quota(l1_bytes=1000))
    described = ledger.describe("secret")
    assert described is not None and described["tenant"] == "acme"
    await registry.delete("other")
    with pytest.raises(NotFound):
        await registry.delete("other")
    assert set(ledger.labelled(top_n=5)) == {"acme", "plain", OTHER}


@pytest.mark.parametrize("bad", ["other", "_default", "", "a b", "-x", "x" * 65, 3, None, "é"])
async def test_bad_labels_are_invalid_input_and_change_nothing(bad: object) -> None:
    ledger = TenantLedger()
    with pytest.raises(InvalidInput):
        await LabelRegistry(ledger).put("s", bad)
    assert ledger.labels() == {}


async def test_a_label_is_one_tenants_and_not_another_tenants_salt() -> None:
    ledger = TenantLedger()
    ledger.charge("plain", L1, 10)
    registry = LabelRegistry(ledger)
    await registry.put("a", "acme")
    with pytest.raises(Conflict):
        await registry.put("b", "acme")
    with pytest.raises(Conflict):
        await registry.put("a", "plain")
    await registry.put("a", "acme2")  # renaming is fine
    assert ledger.labels() == {"a": "acme2"}


def test_a_bad_label_file_stops_the_start_naming_it(tmp_path: Path) -> None:
    path = tmp_path / LABEL_FILE
    path.write_text('{"version": 1, "labels": {"s": "other"}}')
    with pytest.raises(ConfigError, match=LABEL_FILE):
        LabelRegistry.load(path)


def test_hits_are_noted_per_tier() -> None:
    ledger = TenantLedger()
    ledger.charge("t", L1, 10)
    ledger.note_lookup("t", 2, 3)
    ledger.note_hits("t", "disk", 3)
    ledger.note_hits("nobody", "disk", 1)  # holds nothing: `other`
    acct = ledger.account("t")
    assert acct is not None
    assert (acct.l1.hits, acct.l1.misses, acct.tier("disk").hits) == (2, 3, 3)
    assert ledger.labelled(5)[OTHER]["disk"].hits == 1
