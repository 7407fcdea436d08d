"""The W3C trace context an engine request carries, as LOOKUP passes it on (protocol `traceparent`).

vLLM's API server passes the trace headers a request came with (`traceparent`, `tracestate`) into
the engine's `Request.trace_headers`, which the scheduler side of the connector is handed, when
vLLM traces itself (`--otlp-traces-endpoint`; it drops them otherwise); vLLM's own `llm_request`
span has the same parent. `traceparent_of` picks a valid version-00 `traceparent`
out of them (any case of the header name; surrounding blanks dropped; upper-case hex folded), or
"" when there is none or it is malformed: a bad header never fails a lookup, it is only untraced.

Pure: no state, no imports of vLLM or the sidecar.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from kvdepot_connector.protocol import TRACEPARENT_PATTERN

_VALID = re.compile(TRACEPARENT_PATTERN)
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


def traceparent_of(headers: Mapping[str, str] | None) -> str:
    """The request's `traceparent` (validated, lower-case), or ""."""
    if not headers:
        return ""
    value = headers.get("traceparent")
    if value is None:
        for name, given in headers.items():
            if name.lower() == "traceparent":
                value = given
                break
    if not isinstance(value, str):
        return ""
    value = value.strip().lower()
    if not value or _VALID.fullmatch(value) is None:
        return ""
    _, trace_id, span_id, _ = value.split("-")
    if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:  # invalid by the W3C spec
        return ""
    return value
