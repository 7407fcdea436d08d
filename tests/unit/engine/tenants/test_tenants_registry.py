"""QuotaRegistry: quotas written to quotas.json before they take effect, read back at start,
a bad file refused with its name, a failed write changes nothing."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from app.errors import BackendError, ConfigError, InvalidInput, NotFound
from engine.tenants.ledger import TenantLedger
from engine.tenants.quota import LIMIT_MAX, Quota
from engine.tenants.registry import QUOTA_FILE, QuotaRegistry

pytestmark = pytest.mark.anyio


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1, thread_name_prefix="test-state") as pool:
        yield pool


async def test_changes_are_written_then_applied_and_read_back(
    tmp_path: Path, executor: ThreadPoolExecutor
) -> None:
    path = tmp_path / QUOTA_FILE
    ledger = TenantLedger()
    registry = QuotaRegistry(ledger, path, executor)
    await registry.put("a", Quota(l1_bytes=10))
    await registry.put("", Quota(l2_bytes=0))
    await registry.put("ü/x y", Quota(l1_bytes=LIMIT_MAX, l2_bytes=3))
    await registry.put("a", Quota(l1_bytes=11))  # replaces
    await registry.delete("ü/x y")
    assert ledger.quotas() == {"a": Quota(l1_bytes=11), "": Quota(l2_bytes=0)}
    assert json.loads(path.read_text()) == {
        "version": 1,
        "quotas": {"": {"l1_bytes": None, "l2_bytes": 0}, "a": {"l1_bytes": 11, "l2_bytes": None}},
    }
    assert names(tmp_path) == [QUOTA_FILE]  # no temp file left behind
    assert QuotaRegistry.load(path) == ledger.quotas()


async def test_delete_of_a_tenant_without_a_quota_is_not_found(
    tmp_path: Path, executor: ThreadPoolExecutor
) -> None:
    registry = QuotaRegistry(TenantLedger(), tmp_path / QUOTA_FILE, executor)
    with pytest.raises(NotFound):
        await registry.delete("nobody")
    assert not (tmp_path / QUOTA_FILE).exists()


async def test_a_failed_write_changes_nothing(tmp_path: Path, executor: ThreadPoolExecutor) -> None:
    path = tmp_path / QUOTA_FILE
    ledger = TenantLedger()
    registry = QuotaRegistry(ledger, path, executor)
    await registry.put("a", Quota(l1_bytes=1))
    path.unlink()
    path.mkdir()  # the rename onto it fails
    with pytest.raises(BackendError, match=QUOTA_FILE):
        await registry.put("b", Quota(l1_bytes=2))
    with pytest.raises(BackendError):
        await registry.delete("a")
    assert ledger.quotas() == {"a": Quota(l1_bytes=1)}
    assert not (tmp_path / (QUOTA_FILE + ".tmp")).exists()


async def test_a_salt_longer_than_256_characters_is_refused(
    tmp_path: Path, executor: ThreadPoolExecutor
) -> None:
    registry = QuotaRegistry(TenantLedger(), tmp_path / QUOTA_FILE, executor)
    with pytest.raises(InvalidInput, match="256"):
        await registry.put("x" * 257, Quota())
    await registry.put("x" * 256, Quota())


async def test_without_a_path_quotas_live_in_memory_only() -> None:
    ledger = TenantLedger()
    await QuotaRegistry(ledger).put("a", Quota(l1_bytes=0))
    assert ledger.limit("a", "l1") == 0


def test_a_missing_file_means_no_quotas(tmp_path: Path) -> None:
    assert QuotaRegistry.load(tmp_path / QUOTA_FILE) == {}


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{not json", "not JSON"),
        ("", "not JSON"),
        ("[]", "expected an object"),
        ('{"version": 1}', "expected an object"),
        ('{"version": 2, "quotas": {}}', "unsupported version"),
        ('{"version": 1, "quotas": []}', "must be an object"),
        ('{"version": 1, "quotas": {"a": {"l1_bytes": -5}}}', "tenant 'a': l1_bytes"),
        ('{"version": 1, "quotas": {"a": {"l1_bytes": 1.5}}}', "integer"),
        ('{"version": 1, "quotas": {"a": {"l1_bytes": true}}}', "integer"),
        ('{"version": 1, "quotas": {"a": {"l9_bytes": 1}}}', "unknown quota field"),
        ('{"version": 1, "quotas": {"a": 5}}', "JSON object"),
        ('{"version": 1, "quotas": {"' + "s" * 300 + '": {}}}', "256"),
    ],
)
def test_a_bad_file_is_a_config_error_naming_the_file(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / QUOTA_FILE
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        QuotaRegistry.load(path)
    message = caught.value.message
    assert str(path) in message and why in message
    assert "\n" not in message


def test_an_unreadable_file_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / QUOTA_FILE
    path.mkdir()
    with pytest.raises(ConfigError, match=re.escape(str(path))):
        QuotaRegistry.load(path)
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b'{"version": 1, "quotas": {"\xff": {}}}')
    with pytest.raises(ConfigError, match=r"latin1\.json"):
        QuotaRegistry.load(bad)
