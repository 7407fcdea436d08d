"""SpanBuilder: OpenTelemetry spans of each engine request, made from the event bus's START/END pairs.

An EventBus subscriber (`on_events`). Each engine request (by its request id) gets one root span,
`kvdepot.request`, opened at the request's first START and ended when its END_REQUEST operation
ends (or, if some of its spans are still open then, when the last of them ends). Its children:
  - every data-plane operation that names the request (`lookup`, `query_prefetch`, `retrieve`,
    `release`, `store`, `load_blocks`, `save_blocks`, `free_lookup_locks`), named by the operation
    (the request id is an attribute of the root only);
  - `prefetch`, one per L2 adapter a lookup's misses were asked of (attribute `kvdepot.adapter`:
    from locating the chunks there to the last load from it; `kvdepot.chunks` = chunks loaded);
  - `write_behind`, one per adapter and batch of the request's chunks written behind
    (`kvdepot.chunks` = chunks written).
Every span starts and ends at its events' timestamps (`Event.ts_ns`, wall clock), not when this
subscriber sees them. An END whose reason is not "ok" sets the span's status to ERROR.

Cost on the event loop: a span is a registry entry while open and a plain record (api/tracing/otlp.py
`SpanRecord`) handed to the sink when it ends; no SDK span, context or attribute dict is made, and
ids are drawn only for roots (a child's when it is encoded, in the exporter's thread). Sampling is
decided once per request, at its root: `ParentBased(TraceIdRatioBased(sample_ratio))` as the SDK's
sampler decides it (an engine's traceparent: its sampled flag; none: the trace id against the
ratio). An unsampled request keeps only its root's entry (to remember the decision until it ends):
its children are neither registered nor counted, and nothing of it reaches the sink.

Trace context: the LOOKUP START carries the engine's W3C `traceparent` when the engine traces the
request (vLLM `--otlp-traces-endpoint`): the root span is then made a child of the engine's span,
in the engine's trace, and follows its sampled flag.

Chunks written behind after the request ended (a decode save, a queue that was behind) still join
its trace: the contexts of the last `recent` ended roots are kept (drop oldest) for them.

Open spans are a registry keyed by (request id, span name, the bus's pairing number), the number
telling apart concurrent spans of one name (each tensor-parallel worker retrieves the same request).
`sweep(now)` ends what stayed open too long: a child open `orphan_timeout_s`, a root with no open
child silent that long (its END_REQUEST never came: a client that died). Each is ended at `now`
(a root at its last activity, or its latest child's end) with `kvdepot.orphan=true` and counted
(`orphans`). At most `max_open` spans are open at once; past it new ones are not made (counted,
`refused`).

State: the roots, the open children, the recent contexts, counters. Event loop only (the bus's
dispatcher and the sweep task); the sink exports from its own thread.

Primitives in call order: SpanBuilder(sink, orphan_timeout_s, max_open, sample_ratio) ->
on_events(events)...
-> sweep(now_ns)... (periodically) -> close(now_ns) (ends everything still open).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from opentelemetry.trace import get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from api.tracing.export import SpanSink
from api.tracing.otlp import Attributes
from engine.events import Event, Kind

ROOT = "kvdepot.request"
#: data-plane operations that become child spans of their request (by message tag)
CHILD_OPS = frozenset(
    {"lookup", "query_prefetch", "retrieve", "release", "store", "load_blocks", "save_blocks",
     "free_lookup_locks"}
)  # fmt: skip
#: the operation whose END ends the request's root span
END_OP = "end_request"
PREFETCH_OP = "l2.prefetch"
STORE_OP = "l2.store"

_PROPAGATOR = TraceContextTextMapPropagator()
_ORPHAN: Attributes = (("kvdepot.orphan", True),)


@dataclass(slots=True)
class _Root:
    trace_id: int
    span_id: int
    """0 when unsampled (no span is made)."""
    parent_id: int
    """The engine's span (a traceparent's), 0 = none."""
    sampled: bool
    start_ns: int
    last_ns: int
    """Its last event (activity)."""
    open: int = 0
    reach_ns: int = 0
    """The latest end of its children (orphans' included): it ends no earlier."""
    closing_ns: int = 0
    """Its END_REQUEST ended then (0: not yet); it ends once its last open child ends."""


@dataclass(slots=True)
class _Child:
    """An open child of a sampled request: made into a record at its END."""

    name: str
    trace_id: int
    parent_id: int
    request_id: str
    start_ns: int
    adapter: str


Key = tuple[str, str, int]
#: an ended root: (trace id, span id, sampled)
Recent = tuple[int, int, bool]


class SpanBuilder:
    def __init__(
        self, sink: SpanSink, *, orphan_timeout_s: float, max_open: int, sample_ratio: float = 1.0,
        recent: int = 4096,
    ) -> None:  # fmt: skip
        """Finished spans go to `sink`; a request without a traceparent is traced with probability
        `sample_ratio` (by its trace id, as the SDK's TraceIdRatioBased)."""
        if orphan_timeout_s <= 0 or max_open <= 0 or recent <= 0 or not 0 <= sample_ratio <= 1:
            raise ValueError("orphan_timeout_s, max_open and recent must be positive, sample_ratio in [0, 1]")
        self.sink = sink
        self._add = sink.add
        self._bound = TraceIdRatioBased.get_bound_for_rate(sample_ratio)
        self._ids = RandomIdGenerator()
        self.orphan_timeout_ns = int(orphan_timeout_s * 1e9)
        self.max_open = max_open
        self.recent_max = recent
        self.started = 0
        self.ended = 0
        self.orphans = 0
        self.refused = 0
        self.unmatched = 0
        """ENDs without their START (it was refused, dropped by the bus, or came before tracing)."""
        self._roots: dict[str, _Root] = {}
        self._children: dict[Key, _Child] = {}
        self._recent: OrderedDict[str, Recent] = OrderedDict()

    def open_spans(self) -> int:
        """Open children and requests (an unsampled request's entry included)."""
        return len(self._roots) + len(self._children)

    # -- the bus callback ------------------------------------------------------------------------

    def on_events(self, events: Sequence[Event]) -> None:
        for event in events:
            kind = event.kind
            if kind is Kind.START:
                self._on_start(event)
            elif kind is Kind.END:
                self._on_end(event)

    @staticmethod
    def _names(event: Event) -> tuple[str, str] | None:
        """(span name, registry name) of a START/END that makes a child span, or None."""
        op = event.op
        if op in CHILD_OPS:
            return op, op
        if op == PREFETCH_OP and event.tier:
            return "prefetch", "prefetch:" + event.tier
        if op == STORE_OP:
            return "write_behind", "write_behind:" + event.tier
        return None

    def _on_start(self, event: Event) -> None:
        rid = event.request_id
        if not rid:
            return
        root = self._roots.get(rid)
        names = self._names(event)
        if names is None or (root is not None and not root.sampled):
            if root is not None and event.ts_ns > root.last_ns:
                root.last_ns = event.ts_ns
            return
        recent = self._recent.get(rid) if root is None else None
        if recent is not None and not recent[2]:
            return  # a late write of an unsampled request
        if self.open_spans() + 2 > self.max_open:
            self.refused += 1
            return
        if root is not None:
            trace_id, parent_id = root.trace_id, root.span_id
        elif recent is not None:
            trace_id, parent_id = recent[0], recent[1]
        else:
            root = self._new_root(event)
            if not root.sampled:
                return
            trace_id, parent_id = root.trace_id, root.span_id
        name, registry_name = names
        self._children[(rid, registry_name, event.span)] = _Child(
            name, trace_id, parent_id, rid, event.ts_ns, event.tier
        )
        self.started += 1
        if root is not None:
            root.open += 1
            root.last_ns = max(root.last_ns, event.ts_ns)

    def _new_root(self, event: Event) -> _Root:
        """The request's root, sampled as ParentBased(TraceIdRatioBased) decides."""
        trace_id = parent_id = 0
        sampled = False
        if event.trace:
            parent = get_current_span(_PROPAGATOR.extract({"traceparent": event.trace})).get_span_context()
            if parent.is_valid:
                trace_id, parent_id, sampled = parent.trace_id, parent.span_id, parent.trace_flags.sampled
        if not trace_id:
            trace_id = self._ids.generate_trace_id()
            sampled = trace_id & TraceIdRatioBased.TRACE_ID_LIMIT < self._bound
        span_id = self._ids.generate_span_id() if sampled else 0
        ts = event.ts_ns
        root = self._roots[event.request_id] = _Root(trace_id, span_id, parent_id, sampled, ts, ts)
        if sampled:
            self.started += 1
        return root

    def _finish(
        self, child: _Child, end_ns: int, status: str | None = None, attributes: Attributes = ()
    ) -> None:
        """Hand `child`, finished at `end_ns`, to the sink."""
        if child.adapter:
            attributes = (("kvdepot.adapter", child.adapter), *attributes)  # the request id is the root's
        self.sink.add(
            (child.name, child.trace_id, 0, child.parent_id, False, child.start_ns,
             max(end_ns, child.start_ns), attributes, status)
        )  # fmt: skip

    def _on_end(self, event: Event) -> None:
        rid = event.request_id
        if not rid:
            return
        if event.op == END_OP:
            root = self._roots.get(rid)
            if root is not None:
                root.closing_ns = max(event.ts_ns, root.last_ns)
                if root.open == 0:
                    self._end_root(rid, root, root.closing_ns)
            return
        names = self._names(event)
        if names is None:
            return
        child = self._children.pop((rid, names[1], event.span), None)
        if child is None:
            if not self._unsampled(rid):
                self.unmatched += 1
            return
        # _finish and _child_gone inlined: this runs for every span, on the event loop
        start_ns = child.start_ns
        end_ns = event.ts_ns if event.ts_ns > start_ns else start_ns
        chunks = event.detail if event.op in (PREFETCH_OP, STORE_OP) else 0
        attributes: Attributes = (("kvdepot.chunks", chunks),) if chunks else ()
        if child.adapter:
            attributes = (("kvdepot.adapter", child.adapter), *attributes)  # the request id is the root's
        status = None if event.reason == "ok" else event.reason
        record = (child.name, child.trace_id, 0, child.parent_id, False, start_ns, end_ns, attributes, status)
        self._add(record)
        self.ended += 1
        root = self._roots.get(rid)
        if root is not None:
            root.open -= 1
            root.reach_ns = max(root.reach_ns, end_ns)
            root.last_ns = max(root.last_ns, end_ns)
            if root.closing_ns and root.open == 0:
                self._end_root(rid, root, max(root.closing_ns, root.reach_ns))

    def _unsampled(self, rid: str) -> bool:
        root = self._roots.get(rid)
        if root is not None:
            return not root.sampled
        recent = self._recent.get(rid)
        return recent is not None and not recent[2]

    def _child_gone(self, rid: str, end_ns: int, *, active: bool) -> None:
        """A child of `rid` ended at `end_ns` (`active`: by its END, not as an orphan)."""
        root = self._roots.get(rid)
        if root is None:
            return
        root.open -= 1
        root.reach_ns = max(root.reach_ns, end_ns)
        if active:
            root.last_ns = max(root.last_ns, end_ns)
        if root.closing_ns and root.open == 0:
            self._end_root(rid, root, max(root.closing_ns, root.reach_ns))

    def _emit_root(
        self, rid: str, root: _Root, end_ns: int, status: str | None = None, attributes: Attributes = ()
    ) -> None:
        self.sink.add(
            (ROOT, root.trace_id, root.span_id, root.parent_id, bool(root.parent_id), root.start_ns,
             max(end_ns, root.start_ns), (("kvdepot.request_id", rid), *attributes), status)
        )  # fmt: skip

    def _end_root(self, rid: str, root: _Root, end_ns: int) -> None:
        if root.sampled:
            self._emit_root(rid, root, end_ns)
            self.ended += 1
        del self._roots[rid]
        recent = self._recent
        recent[rid] = (root.trace_id, root.span_id, root.sampled)
        recent.move_to_end(rid)
        while len(recent) > self.recent_max:
            recent.popitem(last=False)

    # -- orphans ---------------------------------------------------------------------------------

    def sweep(self, now_ns: int) -> int:
        """End the spans open past the orphan timeout (module docstring). Answers how many (an
        unsampled request's entry is forgotten then, uncounted)."""
        limit = self.orphan_timeout_ns
        n = 0
        for key, child in list(self._children.items()):
            if now_ns - child.start_ns > limit:
                del self._children[key]
                self._finish(child, now_ns, "orphan", _ORPHAN)
                n += 1
                self._child_gone(child.request_id, now_ns, active=False)
        for rid, root in list(self._roots.items()):
            if root.open == 0 and now_ns - root.last_ns > limit:
                del self._roots[rid]
                if root.sampled:
                    self._emit_root(rid, root, max(root.last_ns, root.reach_ns), "orphan", _ORPHAN)
                    n += 1
        self.orphans += n
        self.ended += n
        return n

    def close(self, now_ns: int) -> int:
        """End every open span at `now_ns` (shutdown); answers how many."""
        n = 0
        for child in self._children.values():
            self._finish(child, now_ns, "shutdown")
            n += 1
        for rid, root in self._roots.items():
            if root.sampled:
                end_ns = max(now_ns, root.last_ns, root.reach_ns)
                self._emit_root(rid, root, end_ns, None, (("kvdepot.shutdown", True),))
                n += 1
        self._children.clear()
        self._roots.clear()
        self.ended += n
        return n
