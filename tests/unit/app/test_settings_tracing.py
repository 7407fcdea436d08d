"""The `tracing` settings: off by default, from the environment, bounds, and the bus they need."""

from __future__ import annotations

import pytest

from app.errors import ConfigError
from app.settings_load import load_settings


def test_tracing_is_off_by_default() -> None:
    t = load_settings().tracing
    assert t.otlp_endpoint is None
    assert (t.sample_ratio, t.orphan_timeout_s, t.max_open_spans) == (1.0, 60.0, 100_000)


def test_tracing_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDEPOT_TRACING__OTLP_ENDPOINT", "http://127.0.0.1:4318/v1/traces")
    monkeypatch.setenv("KVDEPOT_TRACING__SAMPLE_RATIO", "0.25")
    t = load_settings().tracing
    assert (t.otlp_endpoint, t.sample_ratio) == ("http://127.0.0.1:4318/v1/traces", 0.25)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"tracing": {"otlp_endpoint": "grpc://collector:4317"}}, "http://"),
        ({"tracing": {"sample_ratio": 1.5}}, "sample_ratio"),
        ({"tracing": {"orphan_timeout_s": 0}}, "orphan_timeout_s"),
        ({"tracing": {"max_open_spans": 1}}, "max_open_spans"),
        (
            {"tracing": {"otlp_endpoint": "http://c:4318/v1/traces"}, "events": {"enabled": False}},
            "events.enabled",
        ),
        ({"events": {"tracked_chunks": 0}}, "tracked_chunks"),
    ],
)
def test_tracing_bounds(overrides: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(overrides)
    assert words in info.value.message and "\n" not in info.value.message
