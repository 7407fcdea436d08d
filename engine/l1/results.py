"""What L1Cache (engine/l1/cache.py) answers and counts: why a reservation was refused, and the
cache's counters (shared with the room maker and the fencing, read by /status and /metrics).

State: the counters, owned by the event loop (through L1Cache, engine/l1/room.py and
engine/l1/fencing.py only).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Refusal(enum.Enum):
    """Why `try_reserve` made no reservation."""

    NO_SPACE = "no_space"
    QUOTA = "quota"


@dataclass(slots=True)
class L1Counters:
    reserved: int = 0
    committed: int = 0
    aborted: int = 0
    evicted: int = 0
    evicted_bytes: int = 0
    deleted: int = 0
    no_space: int = 0
    quota_refused: int = 0
    quota_evicted: int = 0
    expired_reservations: int = 0
    quarantined: int = 0
    quarantine_freed: int = 0
    quarantine_refused: int = 0
