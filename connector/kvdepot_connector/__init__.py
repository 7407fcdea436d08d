"""Engine-side half of kvdepot: the data-plane wire protocol, a client, the vLLM connector.

This package is imported into an inference engine's process. It depends only on pyzmq, msgspec
and torch, and never on the sidecar's own packages. Modules:

- `protocol`: message types, error codes, version (the one definition; the sidecar imports it).
- `layout`:   KV layout arithmetic: dtype sizes, chunk sizes, the chunk format (the sidecar too).
- `errors`:   the exceptions a client raises.
- `shm`:      mapping the sidecar's shared-memory arena.
- `session`:  what both clients share: each operation's message and reply, the handshake state,
              the copies to and from the arena.
- `client`:   `KVDepotClient` (blocking); `aio`: `AsyncKVDepotClient` (asyncio).
- `handles`:  sharing an engine's KV tensors so the sidecar copies itself (CUDA IPC, shared memory).
- `vllm`:     `KVDepotConnector`, a vLLM v1 KV connector built on the client.
"""
