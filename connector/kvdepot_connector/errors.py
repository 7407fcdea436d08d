"""Exceptions raised by the kvdepot client."""

from __future__ import annotations


class KVDepotClientError(Exception):
    """Base class of everything the client raises."""


class SidecarUnavailable(KVDepotClientError):
    """No reply within the timeout, or the sidecar is not there. Treat as a miss and carry on."""


class SidecarError(KVDepotClientError):
    """The sidecar answered with an error reply."""

    def __init__(self, code: str, message: str, retryable: bool) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retryable = retryable


class ProtocolMismatch(KVDepotClientError):
    """The sidecar speaks another protocol version or disagrees on the chunk size."""
