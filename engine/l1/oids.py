"""OidSource: L1 object ids, random 62-bit integers drawn from the OS's CSPRNG in batches.

An object id names one L1 object to the clients (commit, abort, release); ids must be
unguessable, so that no client can name another's reservation, and never 0. `secrets.randbits`
asks the kernel for 8 bytes per id; a store of many chunks draws one id per chunk, so ids are
taken from a buffer refilled with `BATCH` ids per `os.urandom` call instead. Same randomness, one
system call per `BATCH` ids.

State: the buffer of unused ids. Owned by the event loop (the L1 cache), no locks.

Primitives: `next()` -> a fresh random id (the caller checks it is not in use).
"""

from __future__ import annotations

import os
import struct

#: ids drawn per system call
BATCH = 256
_MASK = (1 << 62) - 1


class OidSource:
    def __init__(self, batch: int = BATCH) -> None:
        self._batch = batch
        self._unpack = struct.Struct(f"<{batch}Q").unpack
        self._left: list[int] = []

    def next(self) -> int:
        """A random id in 1..2**62-1."""
        left = self._left
        while True:
            if not left:
                left.extend(self._unpack(os.urandom(8 * self._batch)))
            oid = left.pop() & _MASK
            if oid:
                return oid
