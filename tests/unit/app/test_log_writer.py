"""The log writer (app/logs.py): logging never waits on the stream; a full queue drops lines and
says how many once the stream takes lines again; a flush writes everything queued, in order."""

from __future__ import annotations

import io
import json
import logging
import threading

from app.logs import LineWriter


class BlockedStream(io.StringIO):
    """A stream whose writes wait until `opened` is set (a pipe nobody reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.opened = threading.Event()
        self.waiting = threading.Event()

    def write(self, s: str) -> int:
        self.waiting.set()
        self.opened.wait()
        return super().write(s)


def record(n: int) -> logging.LogRecord:
    return logging.LogRecord("t", logging.INFO, __file__, 1, "line %d", (n,), None)


def test_a_blocked_stream_costs_dropped_lines_not_a_waiting_logger() -> None:
    stream = BlockedStream()
    writer = LineWriter(stream, max_lines=5)
    try:
        writer.emit(record(0))
        assert stream.waiting.wait(10)  # the writer thread holds line 0, blocked in write()
        for n in range(1, 21):  # returns at once: five wait in the queue, the rest are dropped
            writer.emit(record(n))
        assert writer.dropped == 15
        stream.opened.set()
        assert writer.flush_lines(10)
        lines = stream.getvalue().splitlines()
    finally:
        stream.opened.set()
        writer.close()
    assert lines[:6] == [f"line {n}" for n in range(6)]
    assert json.loads(lines[6]) == {"event": "log_lines_dropped", "count": 15, "level": "warning"}
    writer.emit(record(99))  # after close: the thread is gone, the line is not written and nothing waits


def test_flush_writes_every_line_in_order() -> None:
    stream = io.StringIO()
    writer = LineWriter(stream)
    try:
        for n in range(500):
            writer.emit(record(n))
        assert writer.flush_lines(10)
        assert stream.getvalue().splitlines() == [f"line {n}" for n in range(500)]
        assert writer.dropped == 0
    finally:
        writer.close()
