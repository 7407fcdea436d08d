"""Write domains: which writer may write which segment of the L1 arena.

Role: no engine may change bytes it did not write. The arena is cut into segments (engine/l1/arena.py:
one sealed memfd each, mapped read-only by every client); a segment belongs to at most one WRITE
DOMAIN, and only its writers get its read-write descriptor. The domains are the sidecar's own
(`SIDECAR`: prefetched L2 loads, the copies of SAVE_BLOCKS; no engine gets it read-write) and one
per engine instance whose client sessions reserve memory (STORE). An object is allocated only in a
segment of the domain that writes it (a chunk larger than a segment: in consecutive ones, `run`),
so an extent reused in a domain shows only that domain's own old bytes (or zeros): a commit of an
extent its writer never filled cannot expose another instance's bytes.

State: per segment its owner (None: free), its allocated bytes, and the last domain that owned it
(a free segment is zeroed before another domain gets it); per engine instance the pidfds of its
client processes (their lifelines' peers) and whether its sessions are all gone. Owned by the
event loop, through L1Cache and RoomMaker (engine/l1/cache.py, room.py).

Zeroing off the loop: with a `scrubber` (an executor), a segment a gone instance leaves is zeroed
in that thread as soon as it is free (`scrubbing`: its future), and free segments are offered in
the order clean, then still being zeroed; a claim of one still being zeroed waits for its future
(only when nothing clean is free), so no domain ever writes into a segment the thread is
clearing. Without one (and for a sidecar segment an engine takes), the claim zeroes it in place.

A segment enters a domain when the domain first needs room and none of its own segments has it
(`claim`): a free one, or for an engine an empty one of the sidecar's. A mapping cannot be revoked,
so an engine's segment stays its own until every process of the instance has exited (its sessions
ended: `gone`; its processes: pidfds), then, once empty, is free again. Engines together leave
`reserve` segments to the sidecar (one where L2 is configured: its prefetches always find a
place). The writer is told of a segment it may now write (`on_grant`, set by the wiring: its RW
descriptor goes over the instance's lifelines) before the STORE reply naming an offset in it is
sent.

Primitives in call order: `mine(domain)`, `claimable(domain)` (where room may be made), `claim`,
`allocated(offset, size)` / `freed(offset, size)`, `helps(domain)` (victims worth evicting for it),
`note_process(instance, pid)`, `gone(instance)`, `writable(instance)` (segments to offer).

Claim ahead: when an engine domain starts writing into an empty segment of its own and holds no
other empty one, it is handed one more free, clean segment then (`ahead`), so that its clients
map the next segment while they still write into this one (connector/kvdepot_connector/shm.py
maps a grant in a thread of its own: tens of ms for a 64 MiB segment). Never the last free
segment, never past the engines' share: an instance holds at most one empty segment ahead, and
only while a quarter of the segments (at least two) stay free after it, and only for segments of
at least `AHEAD_OBJECTS` of the objects written (a small segment costs little to map).
"""

from __future__ import annotations

import contextlib
import os
import select
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass

from engine.l1.lifecycle import L1Object

#: the sidecar's own domain (its writes: L2 loads, SAVE_BLOCKS copies)
SIDECAR = ""
MAX_PIDS = 1024
#: a segment is claimed ahead only when it holds at least this many objects of the size written
AHEAD_OBJECTS = 16


@dataclass(slots=True)
class DomainCounters:
    claimed: int = 0
    zeroed: int = 0
    released: int = 0
    #: segments zeroed in the scrubber's thread, and claims that had to wait for one
    scrubbed: int = 0
    scrub_waits: int = 0
    ahead: int = 0


class WriteDomains:
    def __init__(
        self, capacity: int, segment_bytes: int, zero: Callable[[int, int], None] | None = None,
        *, reserve: int = 0, scrubber: Executor | None = None,
    ) -> None:
        self.segment = segment_bytes
        self.capacity = capacity
        self.n = -(-capacity // segment_bytes)
        self.owner: list[str | None] = [None] * self.n
        self.used = [0] * self.n
        self._last: list[str | None] = [None] * self.n
        self._mine: dict[str, list[int]] = {}
        #: `runs(domain)` as last computed (dropped whenever a segment changes hands)
        self._runs: dict[str, list[tuple[int, int]]] = {}
        #: instance -> pid -> pidfd of its lifelines' processes
        self._pids: dict[str, dict[int, int]] = {}
        self._gone: set[str] = set()
        self._zero = zero
        self._scrubber = scrubber if zero is not None else None
        #: free segments being zeroed in the scrubber's thread (index -> its future)
        self.scrubbing: dict[int, Future[None]] = {}
        #: segments engines leave to the sidecar's own writes (its L2 loads)
        self.reserve = min(reserve, self.n - 1)
        self.counters = DomainCounters()
        #: called with (instance, segment) when an engine instance may write a segment
        self.on_grant: Callable[[str, int], None] | None = None

    def bounds(self, index: int) -> tuple[int, int]:
        lo = index * self.segment
        return lo, min(lo + self.segment, self.capacity)

    def index(self, offset: int) -> int:
        return offset // self.segment

    def mine(self, domain: str) -> list[int]:
        return self._mine.get(domain, [])

    def writable(self, instance: str) -> list[int]:
        """The segments `instance`'s clients may map read-write (none for the sidecar's domain)."""
        return [] if instance == SIDECAR else list(self.mine(instance))

    def claimable(self, domain: str) -> list[int]:
        """Segments `domain` may take now: free ones, and for an engine the sidecar's empty ones,
        as long as engines leave the sidecar one segment."""
        self._release_orphans()
        free = self._free_segments()
        if domain == SIDECAR:
            return free
        if self._engine_segments() + self.reserve >= self.n:
            return []
        return free + [i for i in self.mine(SIDECAR) if self.used[i] == 0]

    def _free_segments(self) -> list[int]:
        """Free segments, those already clean first (not still being zeroed in the thread)."""
        free = [i for i in range(self.n) if self.owner[i] is None]
        pending = self.scrubbing
        if not pending:
            return free
        busy = {i for i, f in pending.items() if not f.done()}
        return [i for i in free if i not in busy] + [i for i in free if i in busy]

    def _engine_segments(self) -> int:
        return sum(len(v) for k, v in self._mine.items() if k != SIDECAR)

    def claim(self, domain: str, index: int) -> None:
        """`domain` owns segment `index` from now (zeroed first when another domain wrote it)."""
        previous = self.owner[index]
        if previous is not None:
            self._mine[previous].remove(index)
        scrub = self.scrubbing.pop(index, None)
        if scrub is not None:
            if not scrub.done():
                self.counters.scrub_waits += 1
            try:
                scrub.result()
                self._last[index] = None
            except Exception:  # not zeroed there (cancelled at shutdown): zeroed here then
                pass
        last = self._last[index]
        if last is not None and last != domain and self._zero is not None:
            lo, hi = self.bounds(index)
            self._zero(lo, hi - lo)
            self.counters.zeroed += 1
        self.owner[index] = domain
        self._last[index] = domain
        self._mine.setdefault(domain, []).append(index)
        self._runs.clear()
        self.counters.claimed += 1
        if domain != SIDECAR and self.on_grant is not None:
            self.on_grant(domain, index)

    def ahead(self, domain: str, started: int, size: int) -> None:
        """`domain` just began writing into its empty segment `started`: claim it one more free
        clean segment (the one right after, when free) unless it holds another empty one, or
        fewer than a quarter of the segments (at least two) would stay free, or it would go past
        the engines' share, or the segment holds fewer than `AHEAD_OBJECTS` objects of `size`
        bytes (then mapping it costs no more than what copying one of them costs)."""
        if domain == SIDECAR or size * AHEAD_OBJECTS > self.segment:
            return
        used = self.used
        if any(used[i] == 0 for i in self.mine(domain) if i != started):
            return
        free = self._free_segments()
        if len(free) - 1 < max(2, self.n // 4) or self._engine_segments() + 1 + self.reserve >= self.n:
            return
        last, pending = self._last, self.scrubbing

        def clean(i: int) -> bool:
            if i in pending:
                return pending[i].done() and pending[i].exception() is None
            return last[i] in (None, domain)

        ready = [i for i in free if clean(i)]
        if not ready:
            return
        pick = started + 1 if started + 1 in ready else ready[0]
        self.counters.ahead += 1
        self.claim(domain, pick)

    def runs(self, domain: str) -> list[tuple[int, int]]:
        """`domain`'s segments as maximal runs of consecutive ones: (first, last) each."""
        out = self._runs.get(domain)
        if out is not None:
            return out
        out = []
        for i in sorted(self.mine(domain)):
            if out and out[-1][1] == i - 1:
                out[-1] = (out[-1][0], i)
            else:
                out.append((i, i))
        self._runs[domain] = out
        return out

    def run(self, domain: str, count: int) -> list[int] | None:
        """`count` consecutive empty segments `domain` owns or may claim (a chunk larger than a
        segment spans them), or None."""
        mine = set(self.mine(domain))
        claimable = set(self.claimable(domain))
        streak: list[int] = []
        for i in range(self.n):
            if self.used[i] == 0 and (i in mine or i in claimable):
                streak.append(i)
                if len(streak) < count:
                    continue
                new = sum(1 for j in streak if j not in mine)
                if domain == SIDECAR or self._engine_segments() + new + self.reserve <= self.n:
                    return streak
                streak.pop(0)
            else:
                streak = []
        return None

    def _spans(self, offset: int, size: int) -> list[tuple[int, int]]:
        seg, end, out = self.segment, offset + size, []
        while offset < end:
            i = offset // seg
            stop = min(end, (i + 1) * seg)
            out.append((i, stop - offset))
            offset = stop
        return out

    def allocated(self, offset: int, size: int) -> None:
        i = offset // self.segment
        if (offset + size - 1) // self.segment == i:  # within one segment: the usual case
            self.used[i] += size
            return
        for i, n in self._spans(offset, size):
            self.used[i] += n

    def freed(self, offset: int, size: int) -> None:
        for i, n in self._spans(offset, size):
            self.used[i] -= n
            owner = self.owner[i]
            if self.used[i] == 0 and owner in self._gone and not self._alive(owner):
                self._free(i)

    def helps(self, domain: str) -> Callable[[L1Object], bool]:
        """Whether evicting an object may make room `domain` can use: it lies in the domain's own
        segment, one the domain may claim once empty, or one of an instance that is gone."""
        owner, seg, gone = self.owner, self.segment, self._gone
        # The sidecar's segments help an engine only while engines may take one more segment.
        sidecars = domain != SIDECAR and self._engine_segments() + self.reserve < self.n

        def useful(obj: L1Object) -> bool:
            o = owner[obj.offset // seg]
            return o == domain or o in gone or (sidecars and o == SIDECAR)

        return useful

    # --- engine instances' processes ---------------------------------------------------------------

    def note_process(self, instance: str, pid: int) -> None:
        """A process of `instance` holds a lifeline (it may map the instance's segments writable)."""
        self._gone.discard(instance)
        pids = self._pids.setdefault(instance, {})
        if pid in pids:
            return
        if len(pids) >= MAX_PIDS:
            self._prune(instance)
        with contextlib.suppress(OSError):  # already gone
            pids[pid] = os.pidfd_open(pid)

    def gone(self, instance: str) -> None:
        """Every session of `instance` ended: its segments are freed once its processes exited
        and the segments are empty (an instance that never wrote is forgotten at once)."""
        if instance not in self._mine:
            self._drop_pids(instance)
            return
        self._gone.add(instance)
        self._release_orphans()

    def _alive(self, instance: str) -> bool:
        self._prune(instance)
        return bool(self._pids.get(instance))

    def _prune(self, instance: str) -> None:
        """Close the pidfds of exited processes."""
        pids = self._pids.get(instance)
        if not pids:
            return
        poller = select.poll()
        for fd in pids.values():
            poller.register(fd, select.POLLIN)
        dead = {fd for fd, _ in poller.poll(0)}
        for pid, fd in list(pids.items()):
            if fd in dead:
                with contextlib.suppress(OSError):
                    os.close(fd)
                del pids[pid]
        if not pids:
            del self._pids[instance]

    def _drop_pids(self, instance: str) -> None:
        for fd in self._pids.pop(instance, {}).values():
            with contextlib.suppress(OSError):
                os.close(fd)

    def _release_orphans(self) -> None:
        for instance in list(self._gone):
            if self._alive(instance):
                continue
            for i in list(self.mine(instance)):
                if self.used[i] == 0:
                    self._free(i)
            if not self.mine(instance):
                self._gone.discard(instance)
                self._mine.pop(instance, None)
                self._runs.pop(instance, None)
                self._drop_pids(instance)

    def _free(self, index: int) -> None:
        owner = self.owner[index]
        if owner is not None:
            self._mine[owner].remove(index)
        self.owner[index] = None
        self._runs.clear()
        self.counters.released += 1
        zero, scrubber = self._zero, self._scrubber
        if zero is not None and scrubber is not None and self._last[index] is not None:
            lo, hi = self.bounds(index)
            self.scrubbing[index] = scrubber.submit(self._scrub, zero, lo, hi - lo)

    def _scrub(self, zero: Callable[[int, int], None], offset: int, size: int) -> None:
        """In the scrubber's thread: zero a free segment nobody may write until it is claimed."""
        zero(offset, size)
        self.counters.scrubbed += 1

    def close(self) -> None:
        """Wait for the segments being zeroed (the arena is unmapped after) and close pidfds."""
        for scrub in self.scrubbing.values():
            with contextlib.suppress(Exception):
                scrub.result()
        self.scrubbing.clear()
        for instance in list(self._pids):
            self._drop_pids(instance)
