"""Logging set-up: structlog, JSON lines when stdout is not a terminal, readable console otherwise.

Request-scoped fields (request id, operation) are bound with `structlog.contextvars` by api/ and
appear on every line logged while that request is handled. Standard-library loggers (uvicorn, ...)
go through the same renderer. Every line passes `mask_urls` last: the credentials of any URL in
it (a field's value, a message, an error's text) are `***` (app/redact.py), so no setting's secret
is logged, whoever logs the URL.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import orjson
import structlog

from app.redact import redact_text
from app.settings import LoggingSettings


def _orjson_dumps(obj: Any, default: Any = None) -> str:
    return orjson.dumps(obj, default=default).decode()


def _masked(value: Any, depth: int = 0) -> Any:
    if isinstance(value, str):
        return redact_text(value)
    if depth >= 3:
        return value
    if isinstance(value, dict):
        return {k: _masked(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_masked(v, depth + 1) for v in value]
    return value


def mask_urls(_: Any, __: str, event_dict: Any) -> Any:
    """structlog processor: every URL's credentials in the line's values masked."""
    for key, value in event_dict.items():
        if not key.startswith("_"):  # `_record` and the like: the formatter's own
            event_dict[key] = _masked(value)
    return event_dict


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
    shared.append(mask_urls)  # last: an exception's text is masked too
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
    # An HTTP client's line per request (its whole URL: a tenant in a path, a token in a query)
    # is no log line of ours: its failures reach our own lines as exceptions.
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(max(level, logging.WARNING))
