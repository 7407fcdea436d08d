"""The one error hierarchy of kvdepot.

Every error the core raises is a `KVDepotError` subclass with a stable string `code` and a
`retryable` flag, both given in the class statement (`class NotFound(KVDepotError, code=...)`); a
subclass that names neither keeps its base's. The core never raises transport errors: api/ maps
these classes to HTTP statuses (httpkit/errors.py) and to data-plane error codes
(api/dataplane/errors.py), each in one place. Nothing here imports anything else from the package.
"""

from __future__ import annotations

from typing import Any


class KVDepotError(Exception):
    """Base class. `code` is stable and documented; `retryable` tells a client whether to try again."""

    code: str = "internal"
    retryable: bool = False

    def __init_subclass__(cls, *, code: str | None = None, retryable: bool | None = None, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if code is not None:
            cls.code = code
        if retryable is not None:
            cls.retryable = retryable

    def __init__(self, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(message)
        self.message = message
        if retryable is not None:
            self.retryable = retryable

    def __str__(self) -> str:
        return self.message


class ConfigError(KVDepotError, code="config"):
    """A setting is invalid or cannot be honoured (bad value, port in use, unknown key)."""


class InvalidInput(KVDepotError, code="invalid_input"):
    """A request is well-formed but its values are not acceptable."""


class ProtocolError(KVDepotError, code="protocol"):
    """A data-plane frame could not be decoded or violates the protocol."""


class UnsupportedVersion(ProtocolError, code="unsupported_version"):
    """A client speaks a protocol version the sidecar does not."""


class Unauthorized(KVDepotError, code="unauthorized"):
    """A mutating call without the admin token."""


class NotFound(KVDepotError, code="not_found"):
    """The named thing (adapter, quota, request) does not exist."""


class Conflict(KVDepotError, code="conflict"):
    """The thing already exists or is in a state that forbids the operation."""


class NotRegistered(KVDepotError, code="not_registered", retryable=True):
    """A data-plane call referred to an engine that never registered (or the sidecar restarted)."""


class LeaseExpired(KVDepotError, code="lease_expired"):
    """A write reservation or read lock outlived its lease; its memory may have been reused."""


class BackendError(KVDepotError, code="backend", retryable=True):
    """An L2 backend failed (I/O error, connection refused, timeout)."""


class IntegrityError(KVDepotError, code="integrity"):
    """Stored bytes failed their integrity check; they are never returned."""


class AuthenticationError(IntegrityError, code="authentication"):
    """A stored blob was not signed with a key of this deployment; it is never used."""


class UnknownKey(AuthenticationError, code="auth_unknown_key"):
    """A stored blob names a signing key this sidecar does not hold (another key list, a rotation
    half done): a miss, never removed from a shared tier."""


class TransferError(KVDepotError, code="transfer", retryable=True):
    """A copy between device memory and L1 failed."""


class NotOwner(KVDepotError, code="not_owner"):
    """A data-plane call named an engine id or reservation of another engine instance."""


class Overloaded(KVDepotError, code="overloaded", retryable=True):
    """A bounded table (sessions, registrations) is full; try again later."""
