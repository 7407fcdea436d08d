"""Settings of the control plane's exposure: a non-loopback host needs an admin token (or an
explicit opt-out), a token is never empty, and no error line ever shows a secret."""

from __future__ import annotations

import pytest

from app.errors import ConfigError
from app.settings_load import load_settings
from tests.unit.app.test_settings import config_error

SECRET = "s3cret-token-value"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "sidecar.example"])
def test_a_non_loopback_host_without_a_token_is_refused(host: str) -> None:
    message = config_error({"http.host": host})
    assert message.startswith("invalid setting http:")
    assert "http.admin_token" in message and "http.allow_unauthenticated" in message


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_hosts_need_no_token(host: str) -> None:
    assert load_settings({"http.host": host}).http.admin_token is None


def test_a_non_loopback_host_starts_with_a_token_a_token_file_or_the_explicit_opt_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert load_settings({"http.host": "0.0.0.0", "http.admin_token": SECRET}).http.host == "0.0.0.0"
    assert load_settings({"http.host": "0.0.0.0", "http.admin_token_file": "/data/t"}).http.host == "0.0.0.0"
    monkeypatch.setenv("KVDEPOT_HTTP__ALLOW_UNAUTHENTICATED", "true")
    assert load_settings({"http.host": "0.0.0.0"}).http.allow_unauthenticated


@pytest.mark.parametrize("token", ["", "   "])
def test_an_empty_admin_token_is_refused(monkeypatch: pytest.MonkeyPatch, token: str) -> None:
    monkeypatch.setenv("KVDEPOT_HTTP__ADMIN_TOKEN", token)
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert info.value.message.startswith("invalid setting http.admin_token: must not be empty")


def test_error_lines_never_show_a_token_or_a_url_password(monkeypatch: pytest.MonkeyPatch) -> None:
    # A token of the wrong type, next to another error: the line names it without its value.
    message = config_error({"http.admin_token": 12345, "http.host": "0.0.0.0", "http.port": -1})
    assert "12345" not in message and "http.admin_token" in message
    too_long = f"redis://user:{SECRET}@host:6379/0?" + "x" * 1100
    message = config_error({"l2.adapters": [{"type": "redis", "url": too_long}]})
    assert "l2.adapters.0.redis.url" in message and "redis://user:***@host" in message
    assert SECRET not in message


def test_max_body_bytes_is_bounded() -> None:
    assert load_settings().http.max_body_bytes == 64 * 1024
    assert "http.max_body_bytes" in config_error({"http.max_body_bytes": 10})
