"""What the data-plane clients hand back for a store and for a retrieve that copies itself."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvdepot_connector import protocol as p

__all__ = ["Locked", "StoreOutcome"]


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
