"""QuotaSeal: a tenant's fleet quota as stored in Redis, signed with the deployment's key, so that
another writer of the Redis cannot set it (to unlimited, or to any other value).

Role: the fleet ledger (storage/redis/fleet.py) keeps each tenant's l2_bytes quota in one Redis key.
With the deployment's keys (storage/auth.py: the keys that sign blobs, shared by every sidecar of
the Redis) the value is `<limit>:<key id hex>:<MAC hex>`, limit -1 meaning unlimited, and the MAC (keyed
BLAKE3 under a context of its own) covers the key prefix, the tenant and the limit: a value moved
to another tenant or prefix, edited, or written without the key fails. A value that fails is no
quota at all (the caller applies the sidecar's own), never unlimited. Without keys (tools, tests)
values are the plain limit, as before.

What it does not stop: a writer of the Redis may delete the key (each sidecar's own quota then
applies) or put back a value this tenant had before under the same key (a replay).

State: immutable; safe from any thread.

Primitives: QuotaSeal(keys, prefix); seal(salt, limit) -> the value to store;
open(salt, raw) -> the limit (None: unlimited) or INVALID.
"""

from __future__ import annotations

import hmac
from typing import Final

import blake3

from storage.auth import BlobKeys

_CONTEXT = b"kvdepot 2026 fleet quota v1\x00"
INVALID: Final = "invalid"
"""open's answer for a value that is absent, unreadable or not signed with a known key."""


class QuotaSeal:
    __slots__ = ("_keys", "_prefix")

    def __init__(self, keys: BlobKeys | None, prefix: str) -> None:
        self._keys = keys
        self._prefix = prefix.encode("utf-8")

    def _mac(self, key: bytes, salt: str, limit: int) -> bytes:
        hasher = blake3.blake3(key=key)
        for part in (self._prefix, salt.encode("utf-8"), b"%d" % limit):
            hasher.update(len(part).to_bytes(4, "little"))
            hasher.update(part)
        return hasher.digest()

    def seal(self, salt: str, limit: int | None) -> str:
        value = -1 if limit is None else limit
        if self._keys is None:
            return str(value)
        signer = self._keys.signer
        return f"{value}:{signer.key_id.hex()}:{self._mac(signer.key, salt, value).hex()}"

    def open(self, salt: str, raw: bytes | str | None) -> int | str | None:
        """The quota `raw` says: a limit, None for unlimited; INVALID when absent or not sealed."""
        if raw is None or raw in (b"", ""):
            return INVALID
        text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
        parts = text.split(":")
        try:
            value = int(parts[0])
        except ValueError:
            return INVALID
        if self._keys is not None:
            if len(parts) != 3:
                return INVALID
            try:
                key_id, mac = bytes.fromhex(parts[1]), bytes.fromhex(parts[2])
            except ValueError:
                return INVALID
            key = self._keys.mac_key(key_id)
            if key is None or not hmac.compare_digest(mac, self._mac(key, salt, value)):
                return INVALID
        elif len(parts) != 1:
            return INVALID
        if value < -1:
            return INVALID
        return None if value == -1 else value
