"""RespLane: the Redis adapter's bulk lane. Large values move over blocking sockets, in the adapter's
bounded executor threads, without the copies of an asyncio client.

Why: redis.asyncio reads a large bulk reply through asyncio streams in small pieces and copies it
several times; a plain client builds one bytes object per value. The lane sends a SET as the
buffers [RESP header, blob header, payload, RESP trailer] with sendmsg (nothing joined), and reads a
value with recv_into straight into the caller's memory (for load_into: the L1 region itself).

State: a bounded pool of connections (at most `max_connections`; idle ones reused last-in first-out),
a failure epoch and the last failure. The executor threads share it under one lock; the event loop
only reads `epoch`, creates LaneJobs and cancels them. The wire protocol is storage/redis/resp.py.

Commands (each a single-key command, so Redis Cluster routes it):
  connect      TCP or a unix socket, AUTH and SELECT from the URL (resp.connect). rediss:// is not
               spoken here: resp.target_from_url answers None and the adapter keeps such values
               on redis-py (TLS)
  set          SET key value [EX ttl], value = the blob's segments -> OK, NO_SPACE (an OOM reply),
               ERROR (any other error reply)
  get_into     one GET for a value up to whole_get_max, else GETRANGE pieces of PIECE_BYTES in a
               sliding window (storage/redis/read.py, which says why, and how a value replaced
               during the read is told apart). A value of exactly header + len(out) whose header
               says raw (blob_header.fits_in_place) has its payload received into out -> placed(header);
               any other value is received whole into fresh memory -> hit(blob); absent -> MISS.
  The Redis user needs SET, STRLEN, GET and GETRANGE (plus AUTH, SELECT).

Timeouts: every socket call waits at most `timeout_s` for progress, and one command ends by
timeout_s + its bytes / MIN_BYTES_PER_S at the latest. A frozen or silent Redis is therefore a
failure within about timeout_s.

Failures: a socket error, a timeout or a reply that makes no sense closes the connection (a reply
may still be on its way). Socket errors and timeouts also close the idle connections, which are
likely dead too, record the failure and bump `epoch`: a job created under an earlier epoch then
fails at once, without I/O, instead of waiting out its own timeout on the same dead server, so a
whole batch is ERROR within about timeout_s. Connections are made afresh on the next batch. A
command on a reused idle connection that fails with a connection error before any reply byte (the
server restarted meanwhile) is retried once on a new connection, the other idle ones dropped: SET
and reads are idempotent.
Errors raised to the caller: LaneDown (the backend failed), LaneCancelled.

Cancellation: RespLane.cancel(job) (from the event loop) shuts the job's socket down, which wakes
its thread at once (or wakes it from waiting for a connection); the thread drops the connection and
raises LaneCancelled. The caller waits for the thread before it hands its memory back
(storage.inflight.settled).

Primitives in call order: RespLane(resp.target_from_url(url), ...), LaneJob(lane.epoch),
set / get_into (in executor threads), cancel(job) (event loop), close().
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from app.errors import BackendError
from storage.base import OK, LoadResult, OpResult, Status
from storage.codec import blob_header
from storage.redis import read as redis_read
from storage.redis import resp

R = TypeVar("R")

PIECE_BYTES = 1 << 20
WHOLE_GET_MAX = 6 << 20  # blobs up to this size are read with one GET
MIN_BYTES_PER_S = 64e6  # a command may take timeout_s + its bytes at this rate, no longer


class LaneDown(BackendError):
    """The backend failed (unreachable, timed out, connection lost)."""


class LaneCancelled(Exception):
    """The job was cancelled; its socket I/O stopped."""


class LaneJob:
    """One command's handle for cancellation. Created on the loop with the lane's current epoch."""

    __slots__ = ("_cancelled", "_lock", "_sock", "epoch")

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._cancelled = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Stop the job: its socket is shut down (the thread wakes at once), or it never starts."""
        with self._lock:
            self._cancelled = True
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)

    def _attach(self, sock: socket.socket) -> None:
        with self._lock:
            if self._cancelled:
                raise LaneCancelled
            self._sock = sock

    def _detach(self) -> None:
        with self._lock:
            self._sock = None


class RespLane:
    """A bounded pool of blocking RESP connections; set/get_into run in the adapter's executor."""

    def __init__(
        self,
        target: resp.Target,
        *,
        max_connections: int,
        timeout_s: float,
        piece_bytes: int = PIECE_BYTES,
        whole_get_max: int = WHOLE_GET_MAX,
    ) -> None:
        self.target = target
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.piece_bytes = piece_bytes
        self.whole_get_max = whole_get_max
        self.last_error: str | None = None
        self._epoch = 0
        self._cond = threading.Condition()
        self._idle: list[resp.Connection] = []
        self._open = 0
        self._closed = False

    @property
    def epoch(self) -> int:
        """Bumped by every backend failure; jobs of an earlier epoch fail without I/O."""
        return self._epoch

    @property
    def connections(self) -> int:
        return self._open

    def cancel(self, job: LaneJob) -> None:
        """Stop `job` (event loop): its socket is shut down, or, waiting for a connection, it
        wakes and gives up."""
        job.cancel()
        with self._cond:
            self._cond.notify_all()

    # --- commands (executor threads) -----------------------------------------------------------

    def set(
        self, job: LaneJob, key: bytes, segments: Sequence[blob_header.Buffer], ttl_s: int | None
    ) -> OpResult:
        size = sum(memoryview(s).nbytes for s in segments)
        head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (5 if ttl_s else 3, len(key), key, size)
        tail = resp.CRLF + (b"$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(ttl_s)), ttl_s) if ttl_s else b"")

        def run(conn: resp.Connection) -> OpResult:
            conn.send([head, *segments, tail])
            line = conn.readline()
            if line == b"+OK":
                return OK
            if line[:1] != b"-":
                raise resp.ReplyMismatch(f"unexpected SET reply {line[:64]!r}")
            message = resp.error_text(line[1:])
            if message.startswith("OOM"):
                return OpResult(Status.NO_SPACE, f"redis out of memory: {message}")
            return OpResult.error(f"redis: {message}")

        return self._call(job, size, run)

    def get_into(self, job: LaneJob, key: bytes, head_len: int, out: memoryview) -> LoadResult:
        total = head_len + out.nbytes
        if total <= self.whole_get_max:
            return self._call(job, total, lambda conn: redis_read.get_whole(conn, key, head_len, out))
        return self._call(
            job, total, lambda conn: redis_read.get_pieces(conn, key, head_len, out, self.piece_bytes)
        )

    # --- connections ---------------------------------------------------------------------------

    def _call(self, job: LaneJob, nbytes: int, run: Callable[[resp.Connection], R]) -> R:
        for attempt in (0, 1):
            deadline = time.monotonic() + self.timeout_s + nbytes / MIN_BYTES_PER_S
            conn, reused = self._acquire(job, deadline, fresh=attempt > 0)
            try:
                if conn is None:
                    conn = resp.connect(self.target, self.timeout_s, deadline)
                job._attach(conn.sock)
                conn.begin(deadline)
                result = run(conn)
            except LaneCancelled:
                job._detach()
                self._discard(conn)
                raise
            except resp.ReplyMismatch as exc:
                job._detach()
                self._discard(conn)
                raise LaneDown(f"redis {self.target.describe()}: bad reply: {exc}") from None
            except (OSError, ValueError) as exc:  # socket errors, timeouts, unparsable numbers
                job._detach()
                self._discard(conn)
                if job.cancelled:
                    raise LaneCancelled from None
                retry = reused and conn is not None and not conn.got_reply
                if attempt == 0 and retry and isinstance(exc, ConnectionError):
                    continue
                message = f"redis {self.target.describe()}: {type(exc).__name__}: {exc}"
                self._failed(job, message)
                raise LaneDown(message) from None
            job._detach()
            self._release(conn)
            return result
        raise AssertionError("unreachable")

    def _acquire(self, job: LaneJob, deadline: float, *, fresh: bool) -> tuple[resp.Connection | None, bool]:
        """An idle connection (reused=True), or None with a slot reserved for a new one. `fresh`:
        the idle connections are dropped first (they outlived a server restart)."""
        if fresh:
            self._drop_idle()
        with self._cond:
            while True:
                if self._closed:
                    raise LaneCancelled
                if job.cancelled:
                    raise LaneCancelled
                if job.epoch != self._epoch:
                    raise LaneDown(f"redis {self.target.describe()}: {self.last_error}")
                if self._idle:
                    return self._idle.pop(), True
                if self._open < self.max_connections:
                    self._open += 1
                    return None, False
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise LaneDown(f"redis {self.target.describe()}: no connection free in time")
                self._cond.wait(remaining)

    def _release(self, conn: resp.Connection) -> None:
        with self._cond:
            if not self._closed:
                self._idle.append(conn)
                self._cond.notify()
                return
            self._open -= 1
        conn.close()

    def _discard(self, conn: resp.Connection | None) -> None:
        if conn is not None:
            conn.close()
        with self._cond:
            self._open -= 1
            self._cond.notify()

    def _failed(self, job: LaneJob, message: str) -> None:
        def record() -> None:
            if job.epoch == self._epoch:
                self._epoch += 1
                self.last_error = message

        self._drop_idle(record)

    def close(self) -> None:
        """No new commands; idle connections closed (commands in flight are cancelled by their jobs)."""

        def closing() -> None:
            self._closed = True

        self._drop_idle(closing)

    def _drop_idle(self, then: Callable[[], None] | None = None) -> None:
        """Close the idle connections; `then` runs first, under the pool's lock."""
        with self._cond:
            if then is not None:
                then()
            idle, self._idle = self._idle, []
            self._open -= len(idle)
            self._cond.notify_all()
        for conn in idle:
            conn.close()
