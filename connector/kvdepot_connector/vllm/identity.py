"""The engine instance nonce of a vLLM engine: random per start, shared by its scheduler and its
workers, and handed to the workers privately.

The sidecar lets a client act on the requests, read locks and reservations of the instance whose
nonce it says HELLO with, so the nonce must be known to the engine's own processes only. The
scheduler side draws it when the connector is built in the engine-core process
(`new_instance_nonce`: 32 random bytes, hex); the workers learn it from the connector metadata
the scheduler builds every step (`StepPlan.instance`), which vLLM hands from the engine core to
its workers over its own channel between them (the executor's RPC: shared memory between local
processes), so the nonce is in no config, environment variable, file or log line. A worker
connects at engine start under a private nonce of its own (it maps the arena early, before any
step), and joins the scheduler's instance at the first step that names it
(`WorkerSide.follow` -> `KVDepotClient.join_instance`: HELLO again on its connection, a new
lifeline, REGISTER; the arena stays mapped).

It used to be derived from vLLM's `kv_transfer_config.engine_id`, which vLLM logs (and which an
operator may set to the same value on several engines): whoever read the log could act for the
engine. The nonce never enters a cache key: engines of one model still share cached chunks.
"""

from __future__ import annotations

import secrets

NONCE_BYTES = 32


def new_instance_nonce() -> str:
    """A fresh random engine instance nonce (64 lowercase hex characters)."""
    return secrets.token_hex(NONCE_BYTES)
