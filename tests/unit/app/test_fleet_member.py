"""The sidecar's side of the directory: which Redis a tier is (never its credentials), and the
settings that turn registration on."""

from __future__ import annotations

import pytest

from app.errors import ConfigError
from app.fleet_member import shared_fingerprint
from app.settings_load import load_settings
from storage.redis.config import RedisAdapterConfig


def fp(url: str, prefix: str = "kvdepot:") -> str:
    return shared_fingerprint(RedisAdapterConfig(url=url, key_prefix=prefix))


def test_a_shared_tier_is_named_by_its_address_never_its_password() -> None:
    base = fp("redis://:secret-one@cache:6379/0")
    assert base == fp("redis://:another-secret@cache:6379/0") == fp("redis://user:pw@CACHE:6379/0")
    assert "secret" not in base and len(base) == 16
    assert base == fp("redis://:pass/with@slash@cache:6379/0")
    assert base != fp("redis://cache:6379/1")  # another database
    assert base != fp("redis://cache:6380/0")  # another server
    assert base != fp("redis://cache:6379/0", prefix="other:")  # another namespace in it
    assert fp("redis://a:1,b:2/0") == fp("redis://b:2,a:1/0")  # a cluster's seeds in any order


def test_registration_needs_kv_events() -> None:
    with pytest.raises(ConfigError, match=r"kv_events\.endpoint"):
        load_settings({"fleet.directory_url": "http://127.0.0.1:8090"})
    s = load_settings(
        {"fleet.directory_url": "http://127.0.0.1:8090", "kv_events.endpoint": "ipc:///tmp/kvdepot-e"}
    )
    assert s.fleet.directory_heartbeat_s == 2.0 and s.fleet.instance_id is None
    with pytest.raises(ConfigError, match="directory_url"):
        load_settings({"fleet.directory_url": "ftp://x", "kv_events.endpoint": "ipc:///tmp/kvdepot-e"})
