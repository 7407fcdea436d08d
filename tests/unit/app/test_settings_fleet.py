"""The `fleet` settings: defaults, env names, bounds."""

from __future__ import annotations

import pytest

from app.errors import ConfigError
from app.settings_load import load_settings


def test_fleet_defaults() -> None:
    f = load_settings().fleet
    assert (f.heartbeat_s, f.worker_timeout_s, f.dead_kept) == (2.0, 10.0, 256)


def test_fleet_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDEPOT_FLEET__HEARTBEAT_S", "0.2")
    monkeypatch.setenv("KVDEPOT_FLEET__WORKER_TIMEOUT_S", "1")
    monkeypatch.setenv("KVDEPOT_FLEET__DEAD_KEPT", "0")
    f = load_settings().fleet
    assert (f.heartbeat_s, f.worker_timeout_s, f.dead_kept) == (0.2, 1.0, 0)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"fleet": {"heartbeat_s": 0}}, "heartbeat_s"),
        ({"fleet": {"worker_timeout_s": 1e9}}, "worker_timeout_s"),
        ({"fleet": {"dead_kept": -1}}, "dead_kept"),
        ({"fleet": {"heartbeat_s": 3, "worker_timeout_s": 5}}, "at least twice"),
    ],
)
def test_fleet_bounds(overrides: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(overrides)
    assert words in info.value.message and "\n" not in info.value.message
