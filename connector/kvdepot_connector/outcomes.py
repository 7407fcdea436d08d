"""What the data-plane clients hand back for a store and for a retrieve that copies itself."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kvdepot_connector import protocol as p

__all__ = ["Locked", "Posted", "StoreOutcome", "late_reply"]

log = logging.getLogger("kvdepot_connector")


@dataclass(frozen=True, slots=True)
class StoreOutcome:
    stored: int
    existing: int
    no_space: int
    quota: int
    expired: int

    @property
    def complete(self) -> bool:
        """Every requested chunk is now in L1 (stored now or already there)."""
        return self.no_space == 0 and self.quota == 0 and self.expired == 0


@dataclass(frozen=True, slots=True)
class Locked:
    """Arena views (uint8) of a request's read-locked chunks and their object ids: copy out of the
    views, then `release(request_id, oids)`; its answer says whether the copies are valid."""

    views: list[torch.Tensor]
    oids: list[int]
    #: the release-fence words the RETRIEVE named (kvdepot_connector.fences): pass them to
    #: `release`, which then need not wait for its answer when none moved
    fences: list[p.Fence] = field(default_factory=list)
    #: which LOOKUP of the request holds the locks: pass it to `release` too
    epoch: int = 0


def late_reply(op: str, reply: p.Reply) -> tuple[int, int]:
    """The reply to a request sent without waiting, read late: (1 when it is an error, chunks a
    COMMIT could not make visible), each logged. Nothing else is owed: locks expire with their
    lease, a chunk not committed is a miss."""
    if isinstance(reply, p.ErrorReply):
        log.warning("kvdepot: %s sent without waiting failed: %s", op, reply.message)
        return 1, 0
    if isinstance(reply, p.CommitReply) and not all(reply.ok):
        refused = reply.ok.count(False)
        log.warning(
            "kvdepot: a COMMIT sent without waiting stored %d of %d chunks",
            len(reply.ok) - refused,
            len(reply.ok),
        )
        return 0, refused
    return 0, 0


class Posted:
    """The requests a client sent without waiting, by id, oldest first, each with what to do with its
    reply. Bounded: when replies stop coming (a sidecar restarted, a reply lost), the oldest beyond
    `limit` is forgotten (`forgotten` counts them), so a long-lived client never grows without end."""

    #: requests sent without waiting whose replies are remembered
    limit = 4096

    def __init__(self) -> None:
        self._ops: dict[int, str] = {}
        self.forgotten = 0

    def add(self, request_id: int, op: str) -> None:
        while len(self._ops) >= self.limit:
            oldest = next(iter(self._ops))
            del self._ops[oldest]
            self.forgotten += 1
        self._ops[request_id] = op

    def pop(self, request_id: int) -> str | None:
        return self._ops.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._ops)
