"""Logging set-up: structlog, JSON lines when stdout is not a terminal, readable console otherwise.

Request-scoped fields (request id, operation) are bound with `structlog.contextvars` by api/ and
appear on every line logged while that request is handled. Standard-library loggers (uvicorn, ...)
go through the same renderer.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import orjson
import structlog

from app.settings import LoggingSettings


def _orjson_dumps(obj: Any, default: Any = None) -> str:
    return orjson.dumps(obj, default=default).decode()


def configure_logging(settings: LoggingSettings, stream: TextIO | None = None) -> None:
    """Configure structlog and the stdlib root logger, writing to `stream` (stdout by default; a
    benchmark whose stdout is its JSON result logs to stderr). Called once by app/main."""
    out = sys.stdout if stream is None else stream
    as_json = settings.format == "json" or (settings.format == "auto" and not out.isatty())
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any
    if as_json:
        renderer = structlog.processors.JSONRenderer(serializer=_orjson_dumps)
        shared.append(structlog.processors.format_exc_info)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    level = getattr(logging, settings.level.upper())

    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(level),
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    # Access logs are the control plane's own middleware's job (with the request id).
    logging.getLogger("uvicorn.access").disabled = True
