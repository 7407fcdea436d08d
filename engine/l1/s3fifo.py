"""S3FIFOPolicy: S3-FIFO eviction for L1 (Yang et al., "FIFO queues are all you need for cache
eviction", SOSP'23): most chunks are used once, so new ones wait in a small FIFO and only those
used there move on; a ghost queue remembers keys the small FIFO let go.

State, per object: which queue holds it (small S, about 10 % of the bytes, or main M) and a use
counter (0..3). Queues are intrusive doubly linked lists, oldest first, kept twice: over all
objects and per salt (tenant quotas evict a tenant's own chunks). The ghost queue G holds the
ObjectKeys (not oids: those are reused) of objects evicted from S, at most as many as objects are
held (at least GHOST_MIN). Touched only from the event loop, through the L1 cache, no locks.

  on_insert(obj)      into M when its key is a ghost (seen recently, evicted too early), else S
  on_access(obj)      its counter + 1, at most 3: O(1), nothing moves
  candidates([salt])  the eviction order, made lazily while the room walks it:
                      1. while S holds more than its share: S oldest first; a chunk used in S
                         moves to M (not a candidate), an unused one is a candidate
                      2. M oldest first: a chunk with a count > 0 is reinserted at M's end with
                         count - 1, one with 0 is a candidate
                      3. the rest of S
                      Every live object is yielded once per full pass; what the room does not
                      take (locked, pinned, or enough freed) stays where it is.
  on_remove(obj)      out of its queues; its key joins G when it was EVICTED from S (a deletion,
                      a clear or a purge is no sign of reuse)

Moves made during a pass (S to M, reinsertions) are complete before each yield, so a pass may be
abandoned at any point. A pass that frees nothing (everything locked) still ages counters.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from engine.keys import ObjectKey
from engine.l1.lifecycle import L1Object, ObjectState

SMALL_SHARE = 0.10
MAX_FREQ = 3
GHOST_MIN = 64


class _Link:
    __slots__ = ("entry", "next", "prev")

    def __init__(self, entry: _Entry | None) -> None:
        self.entry = entry
        self.prev: _Link = self
        self.next: _Link = self


class _Queue:
    """A FIFO of links, oldest first after the sentinel, and the bytes of its objects."""

    __slots__ = ("end", "nbytes")

    def __init__(self) -> None:
        self.end = _Link(None)
        self.nbytes = 0

    def push(self, link: _Link, size: int) -> None:
        last = self.end.prev
        link.prev, link.next = last, self.end
        last.next = link
        self.end.prev = link
        self.nbytes += size

    def unlink(self, link: _Link, size: int) -> None:
        link.prev.next = link.next
        link.next.prev = link.prev
        link.prev = link.next = link
        self.nbytes -= size

    @property
    def empty(self) -> bool:
        return self.end.next is self.end


class _Entry:
    __slots__ = ("freq", "glink", "main", "obj", "slink")

    def __init__(self, obj: L1Object, main: bool) -> None:
        self.obj = obj
        self.main = main
        self.freq = 0
        self.glink = _Link(self)
        self.slink = _Link(self)


class S3FIFOPolicy:
    name = "s3fifo"

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._small = _Queue()
        self._main = _Queue()
        self._salts: dict[str, tuple[_Queue, _Queue]] = {}
        self._ghost: OrderedDict[ObjectKey, None] = OrderedDict()

    @property
    def ghosts(self) -> int:
        return len(self._ghost)

    def on_insert(self, obj: L1Object) -> None:
        main = obj.key in self._ghost
        if main:
            del self._ghost[obj.key]
        entry = _Entry(obj, main)
        self._entries[obj.oid] = entry
        queues = self._salts.get(obj.key.salt)
        if queues is None:
            queues = self._salts[obj.key.salt] = (_Queue(), _Queue())
        size = obj.size
        if main:
            self._main.push(entry.glink, size)
            queues[1].push(entry.slink, size)
        else:
            self._small.push(entry.glink, size)
            queues[0].push(entry.slink, size)

    def on_access(self, obj: L1Object) -> None:
        entry = self._entries.get(obj.oid)
        if entry is not None and entry.freq < MAX_FREQ:
            entry.freq += 1

    def on_remove(self, obj: L1Object) -> None:
        entry = self._entries.pop(obj.oid, None)
        if entry is None:
            return
        salt = obj.key.salt
        queues = self._salts[salt]
        size = obj.size
        if entry.main:
            self._main.unlink(entry.glink, size)
            queues[1].unlink(entry.slink, size)
        else:
            self._small.unlink(entry.glink, size)
            queues[0].unlink(entry.slink, size)
            if obj.state is ObjectState.EVICTED:
                ghost = self._ghost
                ghost[obj.key] = None
                ghost.move_to_end(obj.key)
                bound = max(len(self._entries), GHOST_MIN)
                while len(ghost) > bound:
                    ghost.popitem(last=False)
        if queues[0].empty and queues[1].empty:
            del self._salts[salt]

    def candidates(self, salt: str | None = None) -> Iterator[L1Object]:
        if salt is None:
            return self._pass(self._small, self._main)
        queues = self._salts.get(salt)
        if queues is None:
            return iter(())
        return self._pass(queues[0], queues[1])

    # --- internals -----------------------------------------------------------------------------

    def _pass(self, small: _Queue, main: _Queue) -> Iterator[L1Object]:
        share = (small.nbytes + main.nbytes) * SMALL_SHARE
        left = small.nbytes  # bytes of S not yet offered or moved
        link = small.end.next
        while link is not small.end and left > share:
            nxt = link.next
            entry = link.entry
            assert entry is not None
            left -= entry.obj.size
            if entry.freq:
                self._promote(entry)
            else:
                yield entry.obj
            link = nxt
        end = main.end
        cursor = end.next
        while cursor is not end:
            nxt = cursor.next
            entry = cursor.entry
            assert entry is not None
            if entry.freq:
                entry.freq -= 1
                self._reinsert(entry)
                if nxt is end:  # it was the last: it is the last again, and its turn comes again
                    nxt = cursor
            else:
                yield entry.obj
            cursor = nxt
        while link is not small.end:
            nxt = link.next
            assert link.entry is not None
            yield link.entry.obj
            link = nxt

    def _promote(self, entry: _Entry) -> None:
        """S -> the end of M, its count starting over."""
        obj = entry.obj
        queues = self._salts[obj.key.salt]
        size = obj.size
        self._small.unlink(entry.glink, size)
        queues[0].unlink(entry.slink, size)
        entry.main = True
        entry.freq = 0
        self._main.push(entry.glink, size)
        queues[1].push(entry.slink, size)

    def _reinsert(self, entry: _Entry) -> None:
        """To the end of M (both views)."""
        obj = entry.obj
        main = self._salts[obj.key.salt][1]
        size = obj.size
        self._main.unlink(entry.glink, size)
        main.unlink(entry.slink, size)
        self._main.push(entry.glink, size)
        main.push(entry.slink, size)
