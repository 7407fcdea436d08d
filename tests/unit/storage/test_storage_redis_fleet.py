"""The fleet ledger's pure parts: the salt of a chunk key, the meta keys (one cluster slot per
tenant, whatever the salt or the prefix), and the config rule that grace exceeds the timeout."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engine.keys import Namespace, ObjectKey
from storage.base import key_salt
from storage.redis.cluster import SlotMap
from storage.redis.config import RedisAdapterConfig
from storage.redis.fleet import META, FleetLedger
from storage.redis.router import RedisRouter
from storage.redis.scan import glob_escape

SALTS = ["", "a", "c/d", "é{x}", "%2F", "x" * 256]


@pytest.mark.parametrize("salt", SALTS)
def test_key_salt_reads_the_salt_of_a_chunk_key(salt: str) -> None:
    key = ObjectKey(Namespace("m/odel", b"\x01" * 8, 0, 0), salt, b"\x02" * 16).serialize()
    assert key_salt(key) == salt
    assert key_salt("not/a/key") is None
    assert key_salt(META + "{s61}:used") is None


@pytest.mark.parametrize("prefix", ["kvdepot:", "a{b:", "a{b}:", "}{", ""])
@pytest.mark.parametrize("salt", SALTS)
def test_a_tenants_meta_keys_share_one_slot_and_name_it(prefix: str, salt: str) -> None:
    config = RedisAdapterConfig(key_prefix=prefix)
    fleet = FleetLedger(RedisRouter(config, lanes=False), prefix, 2.0)
    keys = fleet.meta(salt)
    assert len({SlotMap.slot(k) for k in keys}) == 1
    assert fleet.salt_of_meta(keys[1].decode()) == salt
    assert fleet.salt_of_meta(keys[0].decode()) is None
    assert all(k.decode().startswith(prefix + META) for k in keys)


def test_glob_escape() -> None:
    assert glob_escape("a*b?[c]\\") == "a\\*b\\?\\[c\\]\\\\"


def test_fleet_grace_must_exceed_the_timeout() -> None:
    with pytest.raises(ValidationError, match="fleet_grace_s"):
        RedisAdapterConfig(timeout_s=5, fleet_grace_s=5)
    assert RedisAdapterConfig().scope == "fleet"
    assert RedisAdapterConfig().grace_s == 10
    assert RedisAdapterConfig(timeout_s=30).grace_s == 60  # unset: follows the timeout
    assert RedisAdapterConfig(timeout_s=1, fleet_grace_s=2).grace_s == 2
