"""Matcher: where a request's content appears, at any token offset, in what the instances hold.

A chunk's KV depends on everything before it, so the prefix index (fleet/index.py) finds a chunk
only at its own position after its own prefix. A RAG document placed after another system prompt
is the same tokens at another offset: this finds it, to report (for engines able to blend
non-prefix KV, and for operators measuring repeated content), never to serve.

- Fingerprint of a chunk's own tokens, position-independent: a polynomial hash modulo 2^64,
  fp(t_0..t_{w-1}) = sum (t_k + 1) * B^k, B odd. For a request, the fingerprints of every window of
  `w` tokens come from one prefix sum (numpy, wrapping uint64 arithmetic):
  fp(i) = (H[i+w] - H[i]) * B^-i with H[j] = sum_{k<j} (t_k + 1) * B^k (B^-1 exists modulo 2^64).
- Tables: one per scope (model, tenant as the events name it, LoRA adapter), direct-address
  (slot = fp mod size, the newest chunk wins its slot), updated in place as chunk stores with token
  ids arrive (L1 stores from a client): fingerprint, blake3 of the chunk's tokens (the full-hash
  check that rejects fingerprint collisions), and the chunk's first block hash (the prefix index's
  key: whether, and where, the chunk is still held is read there at match time, so removals need
  no bookkeeping here).
- Repeated content: a chunk stored whose tokens equal (full hash) those of another chunk already in
  its scope's table under another key (another prefix before it) is content computed again that
  prefix caching could not reuse: counted (`repeated`).

State: scope -> table (bounded: `max_scopes`, least recently used dropped), powers of B (grown to
the longest request seen), counters. Event loop only.

Primitives: Matcher(chunk_size, slots, max_scopes) -> learn(scope, tokens, head) | learn_many(items) ...
            find(scope, token_bytes) -> [(offset, head)].
"""

from __future__ import annotations

from collections import OrderedDict

import blake3
import numpy as np
import numpy.typing as npt

B = 0x9E3779B97F4A7C15
B_INV = pow(B, -1, 1 << 64)

Scope = tuple[str, str, str]
"""(model, tenant as published, LoRA adapter name or "")."""

U64 = npt.NDArray[np.uint64]


class _Table:
    __slots__ = ("fp", "full", "head", "used")

    def __init__(self, slots: int) -> None:
        self.fp: U64 = np.zeros(slots, dtype=np.uint64)
        self.head: U64 = np.zeros(slots, dtype=np.uint64)
        self.full: U64 = np.zeros((slots, 2), dtype=np.uint64)
        self.used = 0


class Matcher:
    def __init__(self, chunk_size: int, slots: int = 1 << 15, max_scopes: int = 64) -> None:
        if slots & (slots - 1):
            raise ValueError("slots must be a power of two")
        self.w = chunk_size
        self.slots = slots
        self.max_scopes = max_scopes
        self.tables: OrderedDict[Scope, _Table] = OrderedDict()
        self._pow: U64 = np.ones(1, dtype=np.uint64)
        self._inv: U64 = np.ones(1, dtype=np.uint64)
        self.learnt = 0
        self.repeated = 0
        """chunks stored whose tokens were already held under another key in the same scope"""
        self.collisions = 0
        """fingerprint matches the full-hash check rejected"""

    def _powers(self, n: int) -> tuple[U64, U64]:
        if len(self._pow) < n:
            pw = np.full(n, B, dtype=np.uint64)
            pw[0] = 1
            inv = np.full(n, B_INV, dtype=np.uint64)
            inv[0] = 1
            with np.errstate(over="ignore"):
                self._pow = np.cumprod(pw, dtype=np.uint64)
                self._inv = np.cumprod(inv, dtype=np.uint64)
        return self._pow[:n], self._inv[:n]

    def fingerprint(self, tokens: bytes) -> int:
        t = np.frombuffer(tokens, dtype="<u4").astype(np.uint64) + np.uint64(1)
        pw, _ = self._powers(len(t))
        with np.errstate(over="ignore"):
            return int(np.sum(t * pw, dtype=np.uint64))

    def _table(self, scope: Scope, create: bool) -> _Table | None:
        table = self.tables.get(scope)
        if table is None:
            if not create:
                return None
            if len(self.tables) >= self.max_scopes:
                self.tables.popitem(last=False)
            table = self.tables[scope] = _Table(self.slots)
        self.tables.move_to_end(scope)
        return table

    def learn(self, scope: Scope, tokens: bytes, head: int) -> None:
        """A chunk of `w` tokens (uint32 LE) stored under first block hash `head`."""
        self.learn_many([(scope, tokens, head)])

    def learn_many(self, items: list[tuple[Scope, bytes, int]]) -> None:
        """Several chunks at once (one batch's stores): their fingerprints in one numpy pass."""
        size = 4 * self.w
        items = [item for item in items if len(item[1]) == size]
        if not items:
            return
        pw, _ = self._powers(self.w)
        rows = np.frombuffer(b"".join(t for _, t, _ in items), dtype="<u4").reshape(len(items), self.w)
        with np.errstate(over="ignore"):
            sums: U64 = np.sum((rows.astype(np.uint64) + np.uint64(1)) * pw, axis=1, dtype=np.uint64)
        fps: list[int] = sums.tolist()
        mask = self.slots - 1
        for (scope, tokens, head), fp in zip(items, fps, strict=True):
            table = self._table(scope, True)
            assert table is not None
            full = _full(tokens)
            slot = fp & mask
            old = int(table.fp[slot])
            if old == fp and _same(table.full[slot], full):
                if int(table.head[slot]) != head:
                    self.repeated += 1
            elif old == 0:
                table.used += 1
            table.fp[slot] = fp
            table.full[slot] = full
            table.head[slot] = head
        self.learnt += len(items)

    def find(self, scope: Scope, token_bytes: bytes) -> list[tuple[int, int]]:
        """(offset, head) of every window of the request whose tokens equal a chunk in the scope's
        table (full-hash checked), offsets ascending."""
        table = self._table(scope, False)
        n = len(token_bytes) // 4
        w = self.w
        if table is None or n < w:
            return []
        t = np.frombuffer(token_bytes, dtype="<u4", count=n).astype(np.uint64) + np.uint64(1)
        pw, inv = self._powers(n)
        with np.errstate(over="ignore"):
            h = np.zeros(n + 1, dtype=np.uint64)
            np.cumsum(t * pw, dtype=np.uint64, out=h[1:])
            win = (h[w:] - h[:-w]) * inv[: n - w + 1]
        slots = win & np.uint64(self.slots - 1)
        hits = np.nonzero(table.fp[slots] == win)[0]
        out: list[tuple[int, int]] = []
        for i in hits.tolist():
            slot = int(slots[i])
            if not _same(table.full[slot], _full(token_bytes[4 * i : 4 * (i + w)])):
                self.collisions += 1
                continue
            out.append((i, int(table.head[slot])))
        return out

    def entries(self) -> int:
        return sum(t.used for t in self.tables.values())


def _full(tokens: bytes) -> tuple[int, int]:
    """The full-hash check: 128 bits of blake3 over the chunk's tokens."""
    d = blake3.blake3(tokens).digest(length=16)
    return int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little")


def _same(row: U64, full: tuple[int, int]) -> bool:
    return int(row[0]) == full[0] and int(row[1]) == full[1]


class Matchers:
    """One Matcher per chunk size met (a fleet usually has one), created on first use."""

    def __init__(self, slots: int = 1 << 15, max_scopes: int = 64) -> None:
        self.slots = slots
        self.max_scopes = max_scopes
        self.by_size: dict[int, Matcher] = {}
        self.requests = 0

    def get(self, chunk_size: int, create: bool = True) -> Matcher | None:
        m = self.by_size.get(chunk_size)
        if m is None and create and len(self.by_size) < 8:
            m = self.by_size[chunk_size] = Matcher(chunk_size, self.slots, self.max_scopes)
        return m

    def totals(self) -> dict[str, int]:
        ms = self.by_size.values()
        return {
            "learnt": sum(m.learnt for m in ms), "repeated": sum(m.repeated for m in ms),
            "collisions": sum(m.collisions for m in ms), "entries": sum(m.entries() for m in ms),
        }  # fmt: skip
