"""Logging set-up: structlog, JSON lines when stdout is not a terminal, readable console otherwise.

Request-scoped fields (request id, operation) are bound with `structlog.contextvars` by api/ and
appear on every line logged while that request is handled. Standard-library loggers (uvicorn, ...)
go through the same renderer. Every line passes `mask_urls` last: the credentials of any URL in
it (a field's value, a message, an error's text) are `***` (app/redact.py), so no setting's secret
is logged, whoever logs the URL.

Lines are formatted where they are logged and written by a thread of their own (`LineWriter`),
through a bounded queue: the event loop never waits on its output. A stdout that nobody reads
fast enough (a pipe whose reader is starved, a slow log driver) once held the sidecar's loop, and
with it the data plane and /health, for seconds. When the queue is full a line is dropped and
counted; a `log_lines_dropped` line takes the place of those dropped once there is room again.
`flush_logs()` waits until every line logged so far is written (at exit, and before a reader of a
configured stream looks).

State: the current writer (module-level; replaced by every `configure_logging`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import sys
import threading
from collections.abc import Iterator
from typing import Any, TextIO

import orjson
import structlog
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

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


#: lines waiting for the writer thread before further lines are dropped
QUEUE_LINES = 10_000
#: how long exit waits for the writer to write what is queued
FLUSH_S = 5.0


class LineWriter(logging.Handler):
    """The root logger's handler: formats a record in the logging thread and queues the line;
    a daemon thread writes the lines to `stream` in order."""

    def __init__(self, stream: TextIO, max_lines: int = QUEUE_LINES) -> None:
        super().__init__()
        self.stream = stream
        self.dropped = 0
        self._unreported = 0  # dropped since the last `log_lines_dropped` line
        self._queue: queue.Queue[str | threading.Event | None] = queue.Queue(max_lines)
        self._thread = threading.Thread(target=self._write, name="kvdepot-log-writer", daemon=True)
        self._thread.start()

    def emit(self, record: logging.LogRecord) -> None:  # called under the handler's lock
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        if self._unreported:
            if self._offer(self._dropped_note()):
                self._unreported = 0
            else:
                line = ""
        if not line or not self._offer(line):
            self.dropped += 1
            self._unreported += 1

    def _offer(self, line: str) -> bool:
        try:
            self._queue.put_nowait(line)
        except queue.Full:
            return False
        return True

    def _dropped_note(self) -> str:
        """The line that says how many lines were dropped since the last such line (it takes the
        place of those lines in the output)."""
        return _orjson_dumps({"event": "log_lines_dropped", "count": self._unreported, "level": "warning"})

    def _write(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self.stream.write(item + "\n")
                self.stream.flush()
            except (OSError, ValueError):
                pass  # a closed or broken stream: nothing to write to, nothing to stop for

    def flush_lines(self, timeout_s: float = FLUSH_S) -> bool:
        """Wait until every line queued so far is written; False when that took over `timeout_s`."""
        if not self._thread.is_alive():
            return True
        done = threading.Event()
        with self.lock or contextlib.nullcontext():
            try:
                if self._unreported:
                    self._queue.put(self._dropped_note(), timeout=timeout_s)
                    self._unreported = 0
                self._queue.put(done, timeout=timeout_s)
            except queue.Full:
                return False
        return done.wait(timeout_s)

    def close(self) -> None:
        if self._thread.is_alive():
            self.flush_lines()
            with contextlib.suppress(queue.Full):
                self._queue.put(None, timeout=FLUSH_S)
            self._thread.join(FLUSH_S)
        super().close()


#: the current configuration's writer (at most one)
_writers: list[LineWriter] = []


def dropped_lines() -> int:
    """Log lines dropped so far by the current configuration's writer (its queue was full)."""
    return sum(w.dropped for w in _writers)


class LogCollector(Collector):
    """`kvdepot_log_lines_dropped_total`, read at scrape time."""

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "kvdepot_log_lines_dropped", "Log lines dropped because the log output did not keep up "
            "(each gap is marked by a log_lines_dropped line).", value=dropped_lines(),
        )  # fmt: skip


def flush_logs(timeout_s: float = FLUSH_S) -> bool:
    """Every line logged so far written to the configured stream (False: not within `timeout_s`)."""
    return all(w.flush_lines(timeout_s) for w in _writers)


@atexit.register
def _flush_at_exit() -> None:
    flush_logs()


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
    while _writers:
        _writers.pop().close()  # what the previous configuration queued, written to its stream first
    handler = LineWriter(out)
    _writers.append(handler)
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
