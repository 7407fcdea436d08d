"""Engine-side half of kvdepot: the data-plane wire protocol, a client, the vLLM connector.

This package is imported into an inference engine's process. It depends only on pyzmq, msgspec
and torch, and never on the sidecar's own packages. Modules:

- `protocol`: message types, error codes, version (the one definition; the sidecar imports it).
- `errors`:   the exceptions a client raises.
- `shm`:      mapping the sidecar's shared-memory arena.
- `client`:   `KVDepotClient` (blocking) and `AsyncKVDepotClient` (asyncio).
- `vllm`:     `KVDepotConnector`, a vLLM v1 KV connector built on the client.
"""
