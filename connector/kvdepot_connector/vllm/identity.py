"""The engine instance nonce of a vLLM engine, the same in its scheduler and worker processes.

vLLM fills `kv_transfer_config.engine_id` with a fresh uuid4 when it is not set, and hands the
same config to every process of the engine; its blake3 hash (hex) is the nonce the connector says
HELLO with, so the sidecar lets the scheduler's locks be read and released by the workers, and no
other engine touch them, without any extra plumbing. The nonce never enters a cache key: engines
of one model still share cached chunks.

Engines given the same explicit `engine_id` share one nonce, hence ownership of each other's
requests and reservations (and their engine ids, so their KV planes too when the sidecar copies):
give every engine beside one sidecar its own engine_id, or leave it unset.
"""

from __future__ import annotations

import blake3

NONCE_DOMAIN = b"kvdepot-instance-v1:"


def instance_nonce(engine_id: str) -> str:
    """A 32-byte hex nonce derived from vLLM's kv_transfer_config.engine_id."""
    if not engine_id:
        raise ValueError("kv_transfer_config.engine_id is empty: vLLM sets one per engine; set it")
    return blake3.blake3(NONCE_DOMAIN + engine_id.encode()).hexdigest()
