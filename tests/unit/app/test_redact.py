"""app/redact.py: the credentials of a URL (user part, token-like query parameters) are masked, the
rest stays as written; in free text and in log lines too."""

from __future__ import annotations

import io
import json

import pytest
import structlog

from app.logs import configure_logging
from app.redact import redact_text, redact_url
from app.settings import LoggingSettings


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://user:pw@127.0.0.1:6379/0", "redis://user:***@127.0.0.1:6379/0"),
        ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
        ("https://ghp_TOKEN@example.com/x", "https://***@example.com/x"),
        ("redis://h:1/0?password=pw&db=2", "redis://h:1/0?password=***&db=2"),
        ("http://h/v1?api_key=k&Token=t&x=1", "http://h/v1?api_key=***&Token=***&x=1"),
        ("https://b/o?X-Amz-Signature=s&X-Amz-Credential=c", "https://b/o?X-Amz-Signature=***&X-Amz-Credential=***"),
        ("http://u:p@h/?secret=s&auth=a&sig=g", "http://u:***@h/?secret=***&auth=***&sig=***"),
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"),
        ("http://[::1]:8000/", "http://[::1]:8000/"),
        ("not a url", "not a url"),
    ],
)
def test_credentials_are_masked_and_the_rest_kept(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_a_url_that_cannot_be_parsed_but_may_hold_one_is_hidden() -> None:
    assert redact_url("http://u:p@[::1") == "***"


def test_every_url_in_free_text_is_masked() -> None:
    text = "connect to redis://a:pw1@h:1/0 failed, then 'http://tok@h2/?key=k2' too"
    out = redact_text(text)
    assert "pw1" not in out and "tok" not in out and "k2" not in out
    assert "redis://a:***@h:1/0" in out and "failed, then" in out
    assert redact_text("nothing here") == "nothing here"


def test_no_log_line_carries_a_urls_credentials() -> None:
    out = io.StringIO()
    configure_logging(LoggingSettings(level="info", format="json"), stream=out)
    try:
        log = structlog.get_logger("test.redact")
        log.info("dialing", url="http://u:s3cret@h/", urls=["https://t0ken@h/"], nested={"u": "ws://h/?token=tk1zq"})
        import logging

        logging.getLogger("test.stdlib").warning("export to %s failed", "http://h/?api_key=k3y")
        try:
            raise RuntimeError("bad http://u:exc-pw@h/")
        except RuntimeError:
            log.exception("failed")
    finally:
        configure_logging(LoggingSettings(level="info", format="json"))
    text = out.getvalue()
    for secret in ("s3cret", "t0ken", "tk1zq", "k3y", "exc-pw"):  # none a path could hold by chance
        assert secret not in text, secret
    first = json.loads(text.splitlines()[0])
    assert first["url"] == "http://u:***@h/" and first["nested"] == {"u": "ws://h/?token=***"}
