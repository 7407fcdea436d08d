"""Per-instance credentials: what a sidecar presents to the directory, bound to its instance id.

A sidecar registers (`POST /v1/instances`) with `HMAC-SHA256(secret, instance id)` in hex as its
bearer token, where `secret` is the directory's `directory.instance_secret` (or, unset, its
`http.admin_token`). The directory recomputes it from the id the body names, so a credential
registers only its own id: one sidecar compromised gives away its own registration, never another
instance's nor the admin token. The same credential is what the directory sends back to a
registered instance's `GET /inventory` (the sidecar accepts its `fleet.directory_token` there),
so the URL a registrant names learns nothing it did not hold. An operator derives a sidecar's
credential with `printf %s "$ID" | openssl dgst -sha256 -hmac "$SECRET"`.

State: none. Safe from any thread.

Primitives: instance_credential(secret, instance id) -> hex; credential_ok(secret, id, given).
"""

from __future__ import annotations

import hashlib
import hmac


def instance_credential(secret: str, instance_id: str) -> str:
    """The bearer token of `instance_id`: HMAC-SHA256(secret, id), 64 lowercase hex digits."""
    return hmac.new(secret.encode(), instance_id.encode(), hashlib.sha256).hexdigest()


def credential_ok(secret: str, instance_id: str, given: str | None) -> bool:
    """Whether `given` (the bearer, without its scheme) is `instance_id`'s credential."""
    if not given:
        return False
    return hmac.compare_digest(given.strip().encode(), instance_credential(secret, instance_id).encode())
