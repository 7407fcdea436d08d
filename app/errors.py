"""The one error hierarchy of kvdepot.

Every error the core raises is a `KVDepotError` subclass with a stable string `code` and a
`retryable` flag. The core never raises transport errors: api/ maps these classes to HTTP statuses
(api/http/errors.py) and to data-plane error codes (api/dataplane/errors.py), each in one place.
Nothing here imports anything else from the package.
"""

from __future__ import annotations


class KVDepotError(Exception):
    """Base class. `code` is stable and documented; `retryable` tells a client whether to try again."""

    code: str = "internal"
    retryable: bool = False

    def __init__(self, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(message)
        self.message = message
        if retryable is not None:
            self.retryable = retryable

    def __str__(self) -> str:
        return self.message


class ConfigError(KVDepotError):
    """A setting is invalid or cannot be honoured (bad value, port in use, unknown key)."""

    code = "config"


class InvalidInput(KVDepotError):
    """A request is well-formed but its values are not acceptable."""

    code = "invalid_input"


class ProtocolError(KVDepotError):
    """A data-plane frame could not be decoded or violates the protocol."""

    code = "protocol"


class Unauthorized(KVDepotError):
    """A mutating call without the admin token."""

    code = "unauthorized"


class NotFound(KVDepotError):
    """The named thing (adapter, quota, request) does not exist."""

    code = "not_found"


class Conflict(KVDepotError):
    """The thing already exists or is in a state that forbids the operation."""

    code = "conflict"


class NotRegistered(KVDepotError):
    """A data-plane call referred to an engine that never registered (or the sidecar restarted)."""

    code = "not_registered"
    retryable = True


class CapacityError(KVDepotError):
    """No room can be made in a tier."""

    code = "no_space"
    retryable = True


class QuotaExceeded(KVDepotError):
    """A tenant's quota forbids the operation."""

    code = "quota_exceeded"


class LeaseExpired(KVDepotError):
    """A write reservation or read lock outlived its lease; its memory may have been reused."""

    code = "lease_expired"


class Overloaded(KVDepotError):
    """A bounded queue is full; the work was refused."""

    code = "overloaded"
    retryable = True


class BackendError(KVDepotError):
    """An L2 backend failed (I/O error, connection refused, timeout)."""

    code = "backend"
    retryable = True


class IntegrityError(KVDepotError):
    """Stored bytes failed their integrity check; they are never returned."""

    code = "integrity"


class TransferError(KVDepotError):
    """A copy between device memory and L1 failed."""

    code = "transfer"
    retryable = True


class ShuttingDown(KVDepotError):
    """The service is stopping and accepts no new work."""

    code = "shutting_down"
    retryable = True
