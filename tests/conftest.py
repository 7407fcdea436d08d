"""Fixtures and settings shared by every suite (unit, integration, e2e)."""

from __future__ import annotations

import pytest
import structlog


def pytest_configure(config: pytest.Config) -> None:
    """structlog's own defaults, but an exception's traceback as plain text: unconfigured, it
    renders it with rich (when installed), which took seconds for one logged exception."""
    processors = list(structlog.get_config()["processors"])
    if isinstance(processors[-1], structlog.dev.ConsoleRenderer):
        processors[-1] = structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)
        structlog.configure(processors=processors)


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """`pytest.mark.anyio` tests run on asyncio, the loop the sidecar runs on (session-wide, so
    that a module may share an async fixture)."""
    return "asyncio"
