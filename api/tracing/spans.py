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
subscriber sees them. An END whose reason is not "ok" sets the span's status to ERROR. Roots are
SDK spans (the tracer's sampler decides, following a parent's flag); a child is only remembered at
its START and made at its END, as a finished ReadableSpan handed straight to the span processor:
a fifth of the SDK's cost for a span started and ended at once, on the event loop. A child of an
unsampled root is not made.

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
dispatcher and the sweep task); the SDK's span processor exports from its own thread.

Primitives in call order: SpanBuilder(tracer, processor, resource, orphan_timeout_s, max_open) ->
on_events(events)...
-> sweep(now_ns)... (periodically) -> close(now_ns) (ends everything still open).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Span, SpanContext, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

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
_UNSET = Status(StatusCode.UNSET)


@dataclass(slots=True)
class _Root:
    span: Span
    context: SpanContext
    last_ns: int
    """Its last event (activity)."""
    open: int = 0
    reach_ns: int = 0
    """The latest end of its children (orphans' included): it ends no earlier."""
    closing_ns: int = 0
    """Its END_REQUEST ended then (0: not yet); it ends once its last open child ends."""


@dataclass(slots=True)
class _Child:
    """An open child: made into a finished span at its END (module docstring: no SDK Span)."""

    name: str
    parent: SpanContext
    request_id: str
    start_ns: int
    adapter: str


Key = tuple[str, str, int]


class SpanBuilder:
    def __init__(
        self, tracer: Tracer, processor: SpanProcessor, resource: Resource, *, orphan_timeout_s: float,
        max_open: int, recent: int = 4096, version: str = "",
    ) -> None:  # fmt: skip
        """`tracer` makes the roots; the children, finished, go straight to `processor` (the
        tracer's provider's) with `resource` (the provider's)."""
        if orphan_timeout_s <= 0 or max_open <= 0 or recent <= 0:
            raise ValueError("orphan_timeout_s, max_open and recent must be positive")
        self.tracer = tracer
        self.processor = processor
        self.resource = resource
        self.scope = InstrumentationScope("kvdepot", version or None)
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
        self._recent: OrderedDict[str, SpanContext] = OrderedDict()

    def open_spans(self) -> int:
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
        names = self._names(event)
        if names is None:
            root = self._roots.get(rid)
            if root is not None:
                root.last_ns = max(root.last_ns, event.ts_ns)
            return
        if self.open_spans() + 2 > self.max_open:
            self.refused += 1
            return
        root = self._roots.get(rid)
        if root is not None:
            parent = root.context
        else:
            recent = self._recent.get(rid)
            if recent is not None:
                parent = recent
            else:
                root = self._new_root(event)
                parent = root.context
        name, registry_name = names
        self._children[(rid, registry_name, event.span)] = _Child(name, parent, rid, event.ts_ns, event.tier)
        self.started += 1
        if root is not None:
            root.open += 1
            root.last_ns = max(root.last_ns, event.ts_ns)

    def _new_root(self, event: Event) -> _Root:
        parent = Context()
        if event.trace:
            parent = _PROPAGATOR.extract({"traceparent": event.trace}, context=parent)
        span = self.tracer.start_span(
            ROOT, context=parent, attributes={"kvdepot.request_id": event.request_id},
            start_time=event.ts_ns,
        )  # fmt: skip
        root = self._roots[event.request_id] = _Root(span, span.get_span_context(), event.ts_ns)
        self.started += 1
        return root

    def _finish(
        self, child: _Child, end_ns: int, status: Status = _UNSET, chunks: int = 0, orphan: bool = False
    ) -> None:
        """Hand `child`, finished at `end_ns`, to the span processor: a ReadableSpan made directly
        (a fifth of the SDK's cost for a span started and ended at once), in its parent's trace,
        kept only when the trace is sampled."""
        parent = child.parent
        if not parent.trace_flags.sampled:
            return
        attributes: dict[str, AttributeValue] = {}
        if child.adapter:
            attributes["kvdepot.adapter"] = child.adapter  # the request id is the root's attribute
        if chunks:
            attributes["kvdepot.chunks"] = chunks
        if orphan:
            attributes["kvdepot.orphan"] = True
        context = SpanContext(
            trace_id=parent.trace_id, span_id=self._ids.generate_span_id(), is_remote=False,
            trace_flags=parent.trace_flags, trace_state=parent.trace_state,
        )  # fmt: skip
        self.processor.on_end(
            ReadableSpan(
                name=child.name, context=context, parent=parent, resource=self.resource,
                attributes=attributes, status=status, start_time=child.start_ns,
                end_time=max(end_ns, child.start_ns), instrumentation_scope=self.scope,
            )
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
            self.unmatched += 1
            return
        chunks = event.detail if event.op in (PREFETCH_OP, STORE_OP) else 0
        status = _UNSET if event.reason == "ok" else Status(StatusCode.ERROR, event.reason)
        end_ns = max(event.ts_ns, child.start_ns)
        self._finish(child, end_ns, status, chunks)
        self.ended += 1
        self._child_gone(rid, end_ns, active=True)

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

    def _end_root(self, rid: str, root: _Root, end_ns: int) -> None:
        root.span.end(end_time=end_ns)
        self.ended += 1
        del self._roots[rid]
        recent = self._recent
        recent[rid] = root.context
        recent.move_to_end(rid)
        while len(recent) > self.recent_max:
            recent.popitem(last=False)

    # -- orphans ---------------------------------------------------------------------------------

    def sweep(self, now_ns: int) -> int:
        """End the spans open past the orphan timeout (module docstring). Answers how many."""
        limit = self.orphan_timeout_ns
        n = 0
        for key, child in list(self._children.items()):
            if now_ns - child.start_ns > limit:
                del self._children[key]
                self._finish(child, now_ns, Status(StatusCode.ERROR, "orphan"), orphan=True)
                n += 1
                self._child_gone(child.request_id, now_ns, active=False)
        for rid, root in list(self._roots.items()):
            if root.open == 0 and now_ns - root.last_ns > limit:
                _orphaned(root.span, max(root.last_ns, root.reach_ns))
                n += 1
                del self._roots[rid]
        self.orphans += n
        self.ended += n
        return n

    def close(self, now_ns: int) -> int:
        """End every open span at `now_ns` (shutdown); answers how many."""
        n = 0
        for child in self._children.values():
            self._finish(child, now_ns, Status(StatusCode.ERROR, "shutdown"))
            n += 1
        for root in self._roots.values():
            root.span.set_attribute("kvdepot.shutdown", True)
            root.span.end(end_time=max(now_ns, root.last_ns, root.reach_ns))
            n += 1
        self._children.clear()
        self._roots.clear()
        self.ended += n
        return n


def _orphaned(span: Span, end_ns: int) -> None:
    span.set_attribute("kvdepot.orphan", True)
    span.set_status(Status(StatusCode.ERROR, "orphan"))
    span.end(end_time=end_ns)
