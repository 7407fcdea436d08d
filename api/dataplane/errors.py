"""Error classes -> data-plane error codes, in one place; and the data plane's own errors."""

from __future__ import annotations

from app import errors as e
from kvdepot_connector.protocol import ErrorCode


class HelloRequired(e.ProtocolError, code="hello_required", retryable=True):
    """A message on a connection that has not said HELLO (or whose session was closed)."""


_CODES: dict[type[e.KVDepotError], ErrorCode] = {
    e.InvalidInput: ErrorCode.INVALID_INPUT,
    e.ProtocolError: ErrorCode.MALFORMED_FRAME,
    e.UnsupportedVersion: ErrorCode.UNSUPPORTED_VERSION,
    HelloRequired: ErrorCode.HELLO_REQUIRED,
    e.NotRegistered: ErrorCode.NOT_REGISTERED,
    e.NotFound: ErrorCode.NOT_FOUND,
    e.NotOwner: ErrorCode.NOT_OWNER,
    e.LeaseExpired: ErrorCode.LEASE_EXPIRED,
    e.Overloaded: ErrorCode.OVERLOADED,
    e.Unauthorized: ErrorCode.UNAUTHORIZED,
}


def wire_code(exc: e.KVDepotError) -> ErrorCode:
    for cls in type(exc).__mro__:
        code = _CODES.get(cls)
        if code is not None:
            return code
    return ErrorCode.INTERNAL
