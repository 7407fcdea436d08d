"""StreamTracker: where the directory stands in one sidecar's KV-event stream, and what to do next.

Each batch a sidecar publishes carries a sequence number (from 0 at each start) and the sidecar's
incarnation id (new at each start; in the inventory and heartbeats, in a batch only from sidecars
that appended it to vLLM's format). The tracker decides, per batch received live or by replay:

  APPLY   the next batch expected: apply it, expect the one after;
  SKIP    a batch already applied (a duplicate, one listed by the inventory, an old incarnation's);
  REPLAY  a gap in this incarnation: ask the replay socket for everything from `expected`;
  RESYNC  nothing known yet, a new incarnation or the sequence back at 0 (a restart), or a gap the
          replay could not fill (older than the replay buffer, or no replay socket): replace the
          holdings with `GET /inventory`, whose header names the incarnation and the last
          sequence it covers (`resynced`).

A heartbeat carries the sidecar's incarnation and last sequence too (`published`): a stream that
went quiet right after a lost batch is noticed there (behind for `grace_s`: REPLAY), and a restart
whose first batches were all lost is noticed by its new incarnation (RESYNC).

State: incarnation, expected sequence, retired incarnations (bounded), counters. Event loop only.

Primitives in call order: StreamTracker() -> on_batch(seq, incarnation) -> Action ...
  replay_done(first_seq | None) -> Action; resynced(incarnation, seq); published(inc, seq, now).
"""

from __future__ import annotations

import enum
from collections import deque

_RETIRED_KEPT = 8


class Action(enum.Enum):
    APPLY = "apply"
    SKIP = "skip"
    REPLAY = "replay"
    RESYNC = "resync"


class StreamTracker:
    def __init__(self) -> None:
        self.incarnation: str | None = None
        self.expected: int | None = None
        """The next sequence to apply; None: a resync is due."""
        self.retired: deque[str] = deque(maxlen=_RETIRED_KEPT)
        self.resync_reason = "start"
        self._behind_since: float | None = None
        self.applied = 0
        self.skipped = 0

    @property
    def synced(self) -> bool:
        return self.expected is not None

    def on_batch(self, seq: int, incarnation: str = "") -> Action:
        """`incarnation`: what the batch says ("" in vLLM's format, which carries none: then a
        stream starting over at 0 is a restart)."""
        if incarnation and incarnation in self.retired:
            self.skipped += 1
            return Action.SKIP
        if self.expected is None:
            self.resync_reason = self.resync_reason or "start"
            return Action.RESYNC
        if incarnation and incarnation != self.incarnation:
            self.resync_reason = "incarnation"
            return Action.RESYNC
        if seq == 0 and self.expected > 0:
            self.resync_reason = "restart"
            return Action.RESYNC
        if seq < self.expected:
            self.skipped += 1
            return Action.SKIP
        if seq > self.expected:
            return Action.REPLAY
        self.expected = seq + 1
        self.applied += 1
        self._behind_since = None
        return Action.APPLY

    def replay_done(self, first_seq: int | None, last_seq: int | None) -> Action:
        """After the replayed batches went through `on_batch`: whether the gap is closed. A replay
        that began after what was expected (the buffer had let it go) or sent nothing while a gap
        was known means RESYNC."""
        if self.expected is None:
            return Action.RESYNC
        if first_seq is None or last_seq is None or last_seq + 1 < self.expected:
            # nothing, or nothing past what we had: the gap is older than the replay buffer
            self.resync_reason = "replay_short"
            return Action.RESYNC
        return Action.APPLY

    def gap_unfilled(self, first_replayed: int | None) -> bool:
        """Whether a replay from `expected` started later than `expected` (the batches are gone)."""
        return self.expected is not None and (first_replayed is None or first_replayed > self.expected)

    def need_resync(self, reason: str) -> None:
        self.expected = None
        self.resync_reason = reason

    def resynced(self, incarnation: str, seq: int) -> None:
        """The inventory (of `incarnation`, covering batches up to `seq`) replaced the holdings."""
        if self.incarnation is not None and incarnation != self.incarnation:
            self.retired.append(self.incarnation)
        self.incarnation = incarnation
        self.expected = seq + 1
        self._behind_since = None
        self.resync_reason = ""

    def published(self, incarnation: str | None, seq: int | None, now: float, grace_s: float) -> Action:
        """What a heartbeat says the sidecar has published; REPLAY/RESYNC when behind for too long."""
        if incarnation is None or seq is None or self.expected is None:
            return Action.SKIP
        if incarnation in self.retired:
            return Action.SKIP
        if incarnation != self.incarnation:
            self.resync_reason = "incarnation"
            return Action.RESYNC
        if seq < self.expected:
            self._behind_since = None
            return Action.SKIP
        if self._behind_since is None:
            self._behind_since = now
            return Action.SKIP
        if now - self._behind_since >= grace_s:
            self._behind_since = None
            return Action.REPLAY
        return Action.SKIP
