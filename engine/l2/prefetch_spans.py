"""PrefetchSpans: the START/END "l2.prefetch" event pairs of one prefetch (engine/l2/prefetch.py).

State: the spans open for one prefetch (the whole, and one per adapter asked), on the event loop.

Primitives in call order: begin(tier), loading(tier), located(), loaded(tier, ok), close(outcome, n).
"""

from __future__ import annotations

from engine.events import EventBus


class PrefetchSpans:
    """The START/END "l2.prefetch" pairs of one prefetch: the whole of it (tier "", END detail =
    chunks handed to the request) and each adapter asked (from its locate to its last load, END
    detail = chunks loaded from it). Nothing when the bus is disabled."""

    __slots__ = ("_events", "_open", "_request_id", "_settled")

    def __init__(self, events: EventBus, request_id: str) -> None:
        self._events = events
        self._request_id = request_id
        #: tier ("" = the whole) -> [span, loads running, chunks loaded]
        self._open: dict[str, list[int]] = {}
        self._settled = False

    def begin(self, tier: str) -> None:
        events = self._events
        if events.enabled and tier not in self._open:
            self._open[tier] = [events.start("l2.prefetch", self._request_id, tier=tier), 0, 0]

    def loading(self, tier: str) -> None:
        entry = self._open.get(tier)
        if entry is not None:
            entry[1] += 1

    def located(self) -> None:
        """Loads are under way: an adapter with none to do is done."""
        self._settled = True
        for tier, entry in list(self._open.items()):
            if tier and entry[1] == 0:
                self._end(tier, "ok")

    def loaded(self, tier: str, ok: bool) -> None:
        entry = self._open.get(tier)
        if entry is None:
            return
        entry[1] -= 1
        entry[2] += ok
        if entry[1] == 0 and self._settled:
            self._end(tier, "ok")

    def close(self, outcome: str, attached: int) -> None:
        """The prefetch is over: what is still open ends with `outcome`, the whole last."""
        for tier in [t for t in self._open if t]:
            self._end(tier, outcome)
        whole = self._open.pop("", None)
        if whole is not None:
            self._events.end(whole[0], "l2.prefetch", self._request_id, reason=outcome, detail=attached)

    def _end(self, tier: str, outcome: str) -> None:
        span, _, loaded = self._open.pop(tier)
        self._events.end(span, "l2.prefetch", self._request_id, tier=tier, reason=outcome, detail=loaded)
