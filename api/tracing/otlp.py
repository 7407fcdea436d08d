"""Finished spans as plain records, and their OTLP/protobuf encoding written directly.

The span builder (api/tracing/spans.py) hands each finished span to a sink as a `SpanRecord`, a
plain tuple: making one costs a fraction of a microsecond on the event loop, where an SDK span
(ids, contexts, attribute dicts, a processor) cost several. The OTLP exporter's thread
(api/tracing/export.py) encodes a batch of records with `OtlpEncoder.encode` into the bytes of one
`ExportTraceServiceRequest` (opentelemetry-proto's trace.proto and trace_service.proto): the
resource and the instrumentation scope are encoded once, each span is a few byte strings joined
(3-4 us a span instead of the SDK encoder's 15-25 us, which also held the GIL that long, away
from the loop). Fields are those the SDK's encoder writes for the same span (kind INTERNAL, the
status, the is-remote flags of the parent); tests/unit/api/test_tracing_otlp.py decodes both and
compares them.

State: the encoder's pre-encoded resource and scope (immutable after construction); a child's span
id is drawn when it is encoded (no one refers to it). Any thread.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Iterable, Mapping

from opentelemetry.util.types import AttributeValue

Attributes = tuple[tuple[str, "str | bool | int | float"], ...]

#: (name, trace id, span id (0: drawn at encoding), parent span id (0: none), the parent is remote
#: (a traceparent's), start ns, end ns, attributes, status (None: unset; a string: ERROR, that message))
SpanRecord = tuple[str, int, int, int, bool, int, int, Attributes, "str | None"]

#: trace.proto SpanFlags: the is-remote flag of the parent is known / set
FLAG_HAS_IS_REMOTE = 0x100
FLAG_IS_REMOTE = 0x200
#: SpanKind.SPAN_KIND_INTERNAL, StatusCode.STATUS_CODE_ERROR
KIND_INTERNAL = 1
STATUS_ERROR = 2

_KIND_AND_TIMES = struct.Struct("<BBBQBQ")  # kind (field 6, varint), start (7, fixed64), end (8, fixed64)
_FLAGS = struct.Struct("<BBI")  # flags (field 16, fixed32): a two-byte tag
_DOUBLE = struct.Struct("<Bd")
_UNSET_STATUS = b"\x7a\x00"  # status (field 15), empty: as the SDK writes an UNSET status


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    n &= (1 << 64) - 1
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (`tag`: its first byte, field number << 3 | 2)."""
    return bytes((tag,)) + _varint(len(payload)) + payload


def _string(tag: int, text: str) -> bytes:
    return _field(tag, text.encode())


def encode_key_value(key: str, value: AttributeValue) -> bytes:
    """common.proto KeyValue{key = 1, value = 2: AnyValue{string 1 | bool 2 | int64 3 | double 4}}."""
    if isinstance(value, str):
        any_value = _string(0x0A, value)
    elif isinstance(value, bool):  # before int: a bool is an int
        any_value = b"\x10\x01" if value else b"\x10\x00"
    elif isinstance(value, int):
        any_value = b"\x18" + _varint(value)
    elif isinstance(value, float):
        any_value = _DOUBLE.pack(0x21, value)
    else:
        raise TypeError(f"attribute {key!r}: only str, bool, int and float values are encoded")
    return _string(0x0A, key) + _field(0x12, any_value)


class OtlpEncoder:
    def __init__(
        self, resource: Mapping[str, AttributeValue], resource_schema_url: str, scope_name: str,
        scope_version: str | None,
    ) -> None:  # fmt: skip
        """`resource`: the resource's attributes (service.name, ...); the scope: this library's."""
        encoded_resource = b"".join(_field(0x0A, encode_key_value(k, v)) for k, v in resource.items())
        self._resource = _field(0x0A, encoded_resource)  # ResourceSpans.resource = 1
        self._resource_schema = _string(0x1A, resource_schema_url) if resource_schema_url else b""
        scope = _string(0x0A, scope_name) + (_string(0x12, scope_version) if scope_version else b"")
        self._scope = _field(0x0A, scope)  # ScopeSpans.scope = 1
        self._names: dict[str, bytes] = {}

    def encode(self, records: Iterable[SpanRecord]) -> bytes:
        """The bytes of one ExportTraceServiceRequest{resource_spans = 1: ResourceSpans{resource,
        scope_spans = 2: ScopeSpans{scope, spans = 2...}}} holding `records`."""
        spans = b"".join([_field(0x12, self.encode_span(r)) for r in records])
        resource_spans = self._resource + _field(0x12, self._scope + spans) + self._resource_schema
        return _field(0x0A, resource_spans)

    def encode_span(self, record: SpanRecord) -> bytes:
        """trace.proto Span, its fields in number order."""
        name, trace_id, span_id, parent_id, remote, start_ns, end_ns, attributes, status = record
        if not span_id:
            span_id = random.getrandbits(64) or 1
        encoded_name = self._names.get(name)
        if encoded_name is None:
            encoded_name = self._names[name] = _string(0x2A, name)
        parts = [b"\x0a\x10", trace_id.to_bytes(16, "big"), b"\x12\x08", span_id.to_bytes(8, "big")]
        if parent_id:
            parts += (b"\x22\x08", parent_id.to_bytes(8, "big"))
        parts += (encoded_name, _KIND_AND_TIMES.pack(0x30, KIND_INTERNAL, 0x39, start_ns, 0x41, end_ns))
        for key, value in attributes:
            parts.append(_field(0x4A, encode_key_value(key, value)))
        parts.append(_UNSET_STATUS if status is None else _field(0x7A, _status(status)))
        flags = FLAG_HAS_IS_REMOTE | (FLAG_IS_REMOTE if remote else 0) if parent_id else FLAG_HAS_IS_REMOTE
        parts.append(_FLAGS.pack(0x85, 0x01, flags))
        return b"".join(parts)


def _status(message: str) -> bytes:
    """trace.proto Status{message = 2, code = 3} of an ERROR."""
    return (_string(0x12, message) if message else b"") + bytes((0x18, STATUS_ERROR))
