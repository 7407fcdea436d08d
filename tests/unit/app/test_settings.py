"""Settings: defaults, precedence (flags > env > TOML file > defaults) and one-line ConfigErrors."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from app.errors import ConfigError
from app.settings_load import load_settings


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvdepot.toml"
    path.write_text(text)
    return path


def config_error(overrides: dict[str, object] | None = None, config_file: Path | None = None) -> str:
    """The message of the ConfigError that load_settings raises; it must be one line."""
    with pytest.raises(ConfigError) as info:
        load_settings(overrides, config_file=config_file)
    message = info.value.message
    assert "\n" not in message
    assert info.value.code == "config"
    return message


# --- defaults and precedence -------------------------------------------------------------------


def test_defaults_without_flags_env_or_file() -> None:
    s = load_settings()
    assert s.http.host == "127.0.0.1"
    assert s.http.port == 8080
    assert s.http.admin_token is None
    assert s.data_dir == Path("kvdepot-data")
    assert s.l1.size_gb == 1.0
    assert s.l1.size_bytes == 1 << 30
    assert (s.l1.low_watermark, s.l1.high_watermark) == (0.85, 0.95)
    assert s.logging.level == "info"
    assert s.data_plane_url == f"ipc://{Path('kvdepot-data').resolve()}/dataplane.sock"


def test_toml_file_overrides_defaults(tmp_path: Path) -> None:
    config = write_toml(
        tmp_path,
        f'data_dir = "{tmp_path / "data"}"\n'
        "[http]\nport = 9100\n"
        "[l1]\nsize_gb = 2.5\nchunk_size = 128\n"
        '[data_plane]\nurl = "tcp://127.0.0.1:5555"\n',
    )
    s = load_settings(config_file=config)
    assert s.http.port == 9100
    assert s.l1.size_gb == 2.5
    assert s.l1.chunk_size == 128
    assert s.data_dir == tmp_path / "data"
    assert s.data_plane_url == "tcp://127.0.0.1:5555"
    # What the file does not mention keeps its default.
    assert s.http.host == "127.0.0.1"
    assert s.l1.alignment == 4096


def test_env_overrides_file_field_by_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_toml(tmp_path, "[l1]\nsize_gb = 2.0\nchunk_size = 128\n[http]\nport = 9100\n")
    monkeypatch.setenv("KVDEPOT_L1__SIZE_GB", "3")
    s = load_settings(config_file=config)
    assert s.l1.size_gb == 3.0
    # The env variable replaces one field, not the file's whole [l1] table.
    assert s.l1.chunk_size == 128
    assert s.http.port == 9100


def test_flags_override_env_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_toml(tmp_path, "[l1]\nsize_gb = 2.0\nchunk_size = 128\n[http]\nport = 9100\n")
    monkeypatch.setenv("KVDEPOT_L1__SIZE_GB", "3")
    monkeypatch.setenv("KVDEPOT_HTTP__PORT", "9200")
    s = load_settings({"l1.size_gb": 4, "http.port": None}, config_file=config)
    assert s.l1.size_gb == 4.0
    assert s.l1.chunk_size == 128  # from the file: the flag replaced one field only
    assert s.http.port == 9200  # a flag left unset (None) does not hide the env value


def test_nested_env_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDEPOT_L1__SIZE_GB", "0.5")
    monkeypatch.setenv("KVDEPOT_HTTP__HOST", "0.0.0.0")
    monkeypatch.setenv("KVDEPOT_HTTP__ADMIN_TOKEN", "t0ken")
    monkeypatch.setenv("KVDEPOT_LOGGING__LEVEL", "debug")
    monkeypatch.setenv("KVDEPOT_SHUTDOWN_TIMEOUT_S", "7")
    s = load_settings()
    assert s.l1.size_gb == 0.5
    assert s.l1.size_bytes == 1 << 29
    assert s.http.host == "0.0.0.0"
    assert s.logging.level == "debug"
    assert s.shutdown_timeout_s == 7.0


def test_settings_are_immutable() -> None:
    s = load_settings({"l1.size_gb": 2})
    with pytest.raises(ValidationError):
        s.l1.size_gb = 3
    with pytest.raises(ValidationError):
        s.data_dir = Path("/elsewhere")  # type: ignore[misc]
    assert s.l1.size_gb == 2.0


def test_admin_token_is_masked_in_summary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDEPOT_HTTP__ADMIN_TOKEN", "hunter2-secret")
    s = load_settings()
    assert s.http.admin_token is not None
    assert s.http.admin_token.get_secret_value() == "hunter2-secret"
    summary = s.summary()
    assert summary["http"]["admin_token"] == "***"
    assert "hunter2-secret" not in repr(summary)
    assert "hunter2-secret" not in repr(s)
    monkeypatch.delenv("KVDEPOT_HTTP__ADMIN_TOKEN")
    assert load_settings().summary()["http"]["admin_token"] is None


# --- errors: one line naming the setting -------------------------------------------------------


def test_negative_l1_size_from_flag() -> None:
    message = config_error({"l1.size_gb": -1})
    assert "l1.size_gb" in message
    assert "-1" in message


def test_negative_l1_size_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDEPOT_L1__SIZE_GB", "-2")
    assert "l1.size_gb" in config_error()


def test_negative_l1_size_from_file(tmp_path: Path) -> None:
    assert "l1.size_gb" in config_error(config_file=write_toml(tmp_path, "[l1]\nsize_gb = -1\n"))


def test_non_numeric_env_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDEPOT_HTTP__PORT", "eighty")
    message = config_error()
    assert "http.port" in message
    assert "eighty" in message


def test_out_of_range_port() -> None:
    assert "http.port" in config_error({"http.port": 70000})


@pytest.mark.parametrize(
    ("toml", "name"),
    [
        ("bogus_key = 1\n", "bogus_key"),
        ("[l1]\nsize_gbb = 1\n", "l1.size_gbb"),
        ("[nosuchsection]\nx = 1\n", "nosuchsection"),
    ],
)
def test_unknown_key_in_file(tmp_path: Path, toml: str, name: str) -> None:
    message = config_error(config_file=write_toml(tmp_path, toml))
    assert name in message
    assert "unknown" in message


def test_unknown_nested_env_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDEPOT_L1__SIZE_GIB", "2")
    assert "l1.size_gib" in config_error()


def test_bad_data_plane_url_scheme() -> None:
    message = config_error({"data_plane.url": "http://127.0.0.1:5555"})
    assert "data_plane.url" in message
    assert "ipc://" in message and "tcp://" in message
    assert "http://127.0.0.1:5555" in message


def test_good_data_plane_urls_are_accepted() -> None:
    assert load_settings({"data_plane.url": "tcp://127.0.0.1:5555"}).data_plane_url == "tcp://127.0.0.1:5555"
    assert load_settings({"data_plane.url": "ipc:///tmp/x.sock"}).data_plane_url == "ipc:///tmp/x.sock"


@pytest.mark.parametrize(
    "url", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5555", "tcp://engine:5555"]
)
def test_a_data_plane_beyond_loopback_needs_allow_remote(url: str) -> None:
    message = config_error({"data_plane.url": url})
    assert url in message and "data_plane.allow_remote" in message
    assert load_settings({"data_plane.url": url, "data_plane.allow_remote": True}).data_plane_url == url
    assert load_settings({"data_plane.url": "tcp://[::1]:5555"}).data_plane_url == "tcp://[::1]:5555"


def test_low_watermark_above_high_watermark(tmp_path: Path) -> None:
    config = write_toml(tmp_path, "[l1]\nlow_watermark = 0.9\nhigh_watermark = 0.5\n")
    message = config_error(config_file=config)
    assert "l1.low_watermark" in message
    assert "high_watermark" in message


def test_low_watermark_above_default_high_watermark() -> None:
    assert "low_watermark" in config_error({"l1.low_watermark": 0.99})


def test_equal_watermarks_are_accepted() -> None:
    s = load_settings({"l1.low_watermark": 0.9, "l1.high_watermark": 0.9})
    assert s.l1.low_watermark == s.l1.high_watermark == 0.9


def test_missing_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    message = config_error(config_file=missing)
    assert "config" in message
    assert str(missing) in message


def test_malformed_config_file(tmp_path: Path) -> None:
    config = write_toml(tmp_path, "[l1\nsize_gb = 1\n")
    message = config_error(config_file=config)
    assert str(config) in message


def test_several_errors_stay_on_one_line() -> None:
    message = config_error({"l1.size_gb": -1, "http.port": -5})
    assert "l1.size_gb" in message
    assert "http.port" in message


def test_unknown_environment_variable_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDEPOT_L1_SIZE_GB", "4")  # single underscore: a typo, not a setting
    message = config_error()
    assert "KVDEPOT_L1_SIZE_GB" in message


def test_alignment_must_be_a_power_of_two() -> None:
    assert "l1.alignment" in config_error({"l1.alignment": 3000})


def test_an_l2_adapter_may_not_be_named_like_the_memory_tier() -> None:
    message = config_error({"l2.adapters": [{"type": "mock", "name": "l1"}]})
    assert "l2.adapters" in message and "'l1'" in message
    assert load_settings({"l2.adapters": [{"type": "mock", "name": "L1"}]}).l2.adapters[0].name == "L1"


# --- events ------------------------------------------------------------------------------------


def test_event_defaults() -> None:
    s = load_settings(None)
    assert (s.events.enabled, s.events.capacity, s.events.linger_ms) == (True, 65536, 2.0)


def test_events_from_env_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDEPOT_EVENTS__ENABLED", "false")
    s = load_settings(None, config_file=write_toml(tmp_path, "[events]\ncapacity = 1024\nlinger_ms = 0\n"))
    assert (s.events.enabled, s.events.capacity, s.events.linger_ms) == (False, 1024, 0.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("events.capacity", 0),
        ("events.capacity", 1 << 30),
        ("events.linger_ms", -1),
        ("events.linger_ms", 1e6),
    ],
)
def test_absurd_event_settings_are_refused(field: str, value: object) -> None:
    message = config_error({field: value})
    assert field in message
