"""Release fences, the client's side: the sidecar's generation words mapped read-only, so that a
retrieve can tell after its copy, without asking, that the bytes it copied did not change.

A RETRIEVE reply names the words of the segments its extents span as the sidecar found them when
it locked them (`RetrieveReply.fences`). The sidecar moves a segment's word before any memory of
that segment can be reused and whenever a session's read locks are taken away (engine/l1/fences.py).
After its copy a client reads the words again: none moved, so the RELEASE would answer valid and
may be sent without waiting for the answer (one round trip per retrieve); one moved, so the
client waits for the RELEASE's answer, which checks each object (a moved word costs the round
trip, never a wrong answer).

Only on x86-64, where loads are not reordered with other loads: the words are read after the
copy's loads, in program order, with nothing else to order them. Elsewhere `Fences.open` gives
None and every RELEASE waits for its answer.

State: one read-only shared mapping of the sidecar's sealed table (its descriptor came over the
lifeline as "fences"). Read by whichever thread releases; never written here.
"""

from __future__ import annotations

import mmap
import os
import platform
from collections.abc import Sequence

import numpy as np

from kvdepot_connector import protocol as p

#: architectures whose loads are kept in program order (the check needs nothing more)
ORDERED_LOADS = frozenset({"x86_64", "amd64"})


class Fences:
    def __init__(self, mm: mmap.mmap) -> None:
        self._mm = mm
        self._words = np.frombuffer(mm, dtype=np.uint64)

    @classmethod
    def open(cls, fd: int) -> Fences | None:
        """Map the table behind `fd` (the caller closes it) read-only; None where the words
        cannot be trusted without a barrier (not x86-64) or the table is empty."""
        if platform.machine().lower() not in ORDERED_LOADS:
            return None
        size = os.fstat(fd).st_size
        if size <= 0 or size % 8:
            return None
        return cls(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ))

    def unmoved(self, fences: Sequence[p.Fence]) -> bool:
        """Every word is still the one the RETRIEVE named: the copy made since is valid (and its
        RELEASE may be sent without waiting). False without words, or for a segment the table
        does not have."""
        if not fences:
            return False
        words = self._words
        n = len(words)
        return all(0 <= f.segment < n and int(words[f.segment]) == f.word for f in fences)

    def close(self) -> None:
        del self._words
        self._mm.close()
