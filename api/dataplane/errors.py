"""Error classes -> data-plane error codes, in one place."""

from __future__ import annotations

from app import errors as e
from kvdepot_connector.protocol import ErrorCode

_CODES: dict[type[e.KVDepotError], ErrorCode] = {
    e.InvalidInput: ErrorCode.INVALID_INPUT,
    e.ProtocolError: ErrorCode.MALFORMED_FRAME,
    e.UnsupportedVersion: ErrorCode.UNSUPPORTED_VERSION,
    e.NotRegistered: ErrorCode.NOT_REGISTERED,
    e.NotFound: ErrorCode.NOT_FOUND,
    e.LeaseExpired: ErrorCode.LEASE_EXPIRED,
}


def wire_code(exc: e.KVDepotError) -> ErrorCode:
    for cls in type(exc).__mro__:
        code = _CODES.get(cls)
        if code is not None:
            return code
    return ErrorCode.INTERNAL
