"""fleet/wiring/route.py: the router's settings from its TOML file and flags, refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.errors import ConfigError
from fleet.wiring.route import load_router_settings, parse_engine_flag


def test_flags_win_over_the_file(tmp_path: Path) -> None:
    config = tmp_path / "route.toml"
    config.write_text(
        'directory_url = "http://d:8090/"\nport = 9000\nretries = 2\n'
        '[[engines]]\nurl = "http://a:8000"\nsidecar_id = "a"\n'
    )
    s = load_router_settings(config, {"port": 9100, "host": None})
    assert (s.port, s.retries, s.directory_url) == (9100, 2, "http://d:8090")
    assert [(e.url, e.sidecar_id) for e in s.engines] == [("http://a:8000", "a")]
    flags = [parse_engine_flag("http://b:1=sb"), parse_engine_flag("http://c:1")]
    s = load_router_settings(config, {"engines": flags})
    assert [(e.url, e.sidecar_id) for e in s.engines] == [("http://b:1", "sb"), ("http://c:1", None)]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("port = 1\n", "engines"),
        ('[[engines]]\nurl = "http://a:1"\n[[engines]]\nurl = "http://a:1"\n', "twice"),
        ('[[engines]]\nurl = "http://a:1"\ntimeout = 3\n', "engines.0.timeout"),
        ("port = \n", "route.toml"),
        ('engine_api_key = "k"\n[[engines]]\nurl = "http://a:1"\nport = 1\n', "engines.0.port"),
    ],
)
def test_bad_settings_are_one_line_naming_them(tmp_path: Path, text: str, fragment: str) -> None:
    config = tmp_path / "route.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=fragment) as err:
        load_router_settings(config, {})
    assert "\n" not in err.value.message


def test_a_missing_file_and_a_secret_never_shown(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_router_settings(tmp_path / "nope.toml", {})
    config = tmp_path / "route.toml"
    config.write_text('engine_api_key = ""\n[[engines]]\nurl = "http://a:1"\n')
    with pytest.raises(ConfigError, match="engine_api_key") as err:
        load_router_settings(config, {})
    s = load_router_settings(None, {"engines": [{"url": "http://a:1"}], "engine_api_key": "sekrit"})
    assert "sekrit" not in repr(s) and "sekrit" not in err.value.message
