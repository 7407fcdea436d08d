"""The adapter registry (storage/registry.py): one line per type gives the settings' union and the
builder, and each adapter declares its capabilities (storage/base.py) and its config what it says of
itself (storage/config.py), so that the engine never needs to know the type."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import TypeAdapter, ValidationError

from app.settings import L2Settings
from storage.config import AdapterConfigBase
from storage.registry import ADAPTERS, AdapterConfig, AdapterRegistry, build_adapter

pytestmark = pytest.mark.anyio


def test_every_registered_type_parses_from_its_type_field() -> None:
    assert ADAPTERS.types()[:4] == ["disk", "slab", "redis", "mock"]  # a new type: one more line
    parse = TypeAdapter(AdapterConfig).validate_python
    for kind in ADAPTERS.types():
        config = parse({"type": kind})
        assert type(config) is ADAPTERS.config_class(kind)
        assert (config.type, config.name) == (kind, kind)
    with pytest.raises(ValidationError):
        parse({"type": "tape"})
    settings = L2Settings.model_validate({"adapters": [{"type": "mock", "name": "m"}, {"type": "slab"}]})
    assert [a.type for a in settings.adapters] == ["mock", "slab"]
    assert [a.type for a in L2Settings().adapters] == ["disk"]


def test_a_type_is_registered_once_with_a_config_of_that_type() -> None:
    registry = AdapterRegistry()
    registry.register("mock", "storage.mock.config:MockAdapterConfig", "storage.mock.adapter:build")
    with pytest.raises(ValueError, match="registered already"):
        registry.register("mock", "storage.mock.config:MockAdapterConfig", "storage.mock.adapter:build")
    with pytest.raises(ValueError, match="must default to 'tape'"):
        registry.register("tape", "storage.mock.config:MockAdapterConfig", "storage.mock.adapter:build")
    assert registry.config_union() is registry.config_class("mock")  # one type: no union needed
    with pytest.raises(TypeError, match="unknown adapter config"):
        registry.build(ADAPTERS.config_class("disk").model_validate({}), None)  # type: ignore[arg-type]


def test_configs_say_what_the_engine_needs_of_them() -> None:
    parse = TypeAdapter(AdapterConfig).validate_python
    redis = parse({"type": "redis", "url": "redis://user:secret@Host:7000,h2:7001/0", "key_prefix": "p:"})
    assert "secret" not in redis.redacted().model_dump_json()
    assert redis.shared_location() == "redis|h2:7001,host:7000|0|p:"
    assert redis.local_paths() == []
    disk = parse({"type": "disk", "paths": ["/srv/a", "/srv/b"]})
    slab = parse({"type": "slab", "paths": ["/dev/nvme0n1"]})
    assert disk.local_paths() == [Path("/srv/a"), Path("/srv/b")]
    assert slab.local_paths() == [Path("/dev/nvme0n1")]
    for config in (disk, slab, parse({"type": "mock"})):
        assert config.redacted() is config
        assert config.shared_location() is None
    assert isinstance(redis, AdapterConfigBase)


async def test_each_adapter_declares_its_capabilities(tmp_path: Path) -> None:
    parse = TypeAdapter(AdapterConfig).validate_python
    expect = {  # type -> (pins, fleet, scan, shared)
        "disk": (True, False, False, False),
        "slab": (False, False, False, False),
        "redis": (False, True, True, True),
        "mock": (False, False, False, False),
    }
    for kind, (pins, fleet, scan, shared) in expect.items():
        adapter = build_adapter(parse({"type": kind}), tmp_path)  # building starts no I/O
        try:
            caps = adapter.capabilities()
            has = (caps.pins is not None, caps.fleet is not None, caps.scan is not None)
            assert has == (pins, fleet, scan)
            assert adapter.shared is shared
            assert adapter.kind == kind
        finally:
            await adapter.close()
    local = build_adapter(parse({"type": "redis", "scope": "local"}), tmp_path)
    assert local.capabilities().fleet is None and local.capabilities().scan is not None
    await local.close()
