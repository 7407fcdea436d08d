"""kvdepot for vLLM: `KVDepotConnector`, a vLLM v1 KV connector backed by the kvdepot sidecar.

Load it the standard way::

    --kv-transfer-config '{"kv_connector": "KVDepotConnector",
                           "kv_connector_module_path": "kvdepot_connector.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvdepot_url": "ipc:///path/dataplane.sock"}}'

Modules: `connector` (the vLLM class, a thin shell), `scheduler` and `worker` (the logic of each
side, free of vLLM imports so they are testable alone), `plan` (what the scheduler hands to the
workers each step), `guard` (a sidecar that does not answer turns into misses, then is retried).
The vLLM class is imported lazily so that importing this package needs no vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVDepotConnector", "KVDepotConnectorMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvdepot_connector.vllm import connector

        return getattr(connector, name)
    raise AttributeError(name)
