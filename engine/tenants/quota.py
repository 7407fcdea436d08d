"""Quota: one tenant's byte limits per tier, and the names every tenant module shares.

A tenant is a `cache_salt`; the empty salt is the default tenant, written `_default` in URLs and
metric labels. A tier is `l1` or the name of an L2 adapter (no adapter may be named `l1`).
`l1_bytes` limits the tenant's bytes in L1 (engine/l1/cache.py); `l2_bytes` limits its bytes in
each L2 adapter separately (engine/l2/store.py, at write-behind). None means unlimited; 0 means the
tenant stores nothing in that tier. `pinned_bytes` limits what the tenant's prefix pins may hold in
each tier (engine/pins/): a pin past it is refused; pinned chunks count against `l1_bytes` and
`l2_bytes` like any other.

Pure values, no state; nothing here imports the rest of the package.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from app.errors import InvalidInput

L1 = "l1"
"""The tier name of L1 in the ledger, the HTTP answers and the metrics."""
DEFAULT_TENANT = "_default"
"""How the empty salt is written in URLs and metric labels."""
MAX_SALT_LEN = 256
LIMIT_MAX = 1 << 62
FIELDS = ("l1_bytes", "l2_bytes", "pinned_bytes")


def display_name(salt: str) -> str:
    """The salt as URLs and metric labels write it."""
    return salt or DEFAULT_TENANT


def check_salt(salt: str) -> str:
    if len(salt) > MAX_SALT_LEN:
        raise InvalidInput(f"cache_salt must be at most {MAX_SALT_LEN} characters")
    return salt


def _check_limit(name: str, value: object) -> None:
    # bool is an int subclass: refuse it explicitly, like floats and strings.
    if value is None:
        return
    if type(value) is not int:
        raise InvalidInput(f"{name} must be an integer number of bytes or null, got {type(value).__name__}")
    if not 0 <= value <= LIMIT_MAX:
        raise InvalidInput(f"{name} must be in 0..{LIMIT_MAX} (2**62) or null, got {value}")


@dataclass(frozen=True, slots=True)
class Quota:
    l1_bytes: int | None = None
    l2_bytes: int | None = None
    pinned_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_limit("l1_bytes", self.l1_bytes)
        _check_limit("l2_bytes", self.l2_bytes)
        _check_limit("pinned_bytes", self.pinned_bytes)

    def limit(self, tier: str) -> int | None:
        """The limit in `tier`: `l1_bytes` for L1, `l2_bytes` for every L2 adapter."""
        return self.l1_bytes if tier == L1 else self.l2_bytes

    def to_json(self) -> dict[str, int | None]:
        """The fields as JSON; `pinned_bytes` only when set (files written before it stay the same)."""
        out = {"l1_bytes": self.l1_bytes, "l2_bytes": self.l2_bytes}
        return out if self.pinned_bytes is None else out | {"pinned_bytes": self.pinned_bytes}

    @classmethod
    def from_json(cls, data: object) -> Quota:
        """From a JSON object with the fields above (missing = null). InvalidInput when malformed."""
        if not isinstance(data, Mapping):
            raise InvalidInput(f"a quota must be a JSON object, got {type(data).__name__}")
        unknown = sorted(str(k) for k in data if k not in FIELDS)
        if unknown:
            raise InvalidInput(f"unknown quota field(s) {', '.join(unknown)}; fields are {', '.join(FIELDS)}")
        values: dict[str, Any] = {name: data.get(name) for name in FIELDS}
        return cls(**values)
