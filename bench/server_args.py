"""`kvdepot bench server`'s arguments and constants (bench/server.py runs it, bench/server_worker.py
is its client process, which parses the same arguments)."""

from __future__ import annotations

import argparse

DTYPES = ("bfloat16", "float16", "float32")  # torch's names; torch is imported by the clients only
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: how far ahead of now a step is scheduled, so that every client has read it before it starts
LEAD_S = 0.01
#: PINGs timed before each run (client 0): the round trip every call pays; and as many again,
#: each right after a memmove of one request's bytes (what a call after a copy pays)
PINGS = 200
PINGS_AFTER_COPY = 50
#: the operations of a store and a retrieve, as the sidecar's /metrics names them
SIDECAR_OPS = ("store", "commit", "lookup", "retrieve", "release")
WORKER_ARGS = (
    "requests", "chunks_per_request", "layers", "kv_heads", "head_dim", "dtype", "chunk_tokens", "commit",
    "retrieve",
)  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="use a running sidecar at this data-plane URL instead of starting one")
    p.add_argument("--requests", type=int, default=4, help="requests per client")
    p.add_argument("--chunks-per-request", type=int, default=16, help="without --chunk-mib")
    p.add_argument("--layers", type=int, default=32, help="without --chunk-mib")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=DTYPES, default="float16")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--chunk-mib", type=int, nargs="+", help="chunk sizes in MiB (by the number of layers)")
    p.add_argument("--request-mib", type=int, default=64, help="bytes of one request with --chunk-mib")
    p.add_argument("--clients", type=int, nargs="+", default=[1], help="client processes at once")
    p.add_argument("--lookups", type=int, default=1000, help="lookup samples for the latency figures")
    p.add_argument("--prompt-tokens", type=int, help="also time LOOKUPs of a prompt this long")
    p.add_argument("--prompt-samples", type=int, default=300)
    p.add_argument(
        "--kv-events-endpoint",
        help="start the sidecar with KV events on this ZMQ endpoint (e.g. tcp://127.0.0.1:5557), "
        "with a subscriber in this process reading every batch",
    )
    p.add_argument(
        "--tracing", action="store_true",
        help="start the sidecar with tracing exported over OTLP/HTTP to a receiver in this process "
        "(which counts the spans)",
    )  # fmt: skip
    p.add_argument(
        "--commit", choices=("post", "wait"), default="post",
        help="a store's COMMIT sent without waiting for its answer (post: one round trip per store; "
        "a refused commit is counted when the next call reads its reply) or waited for",
    )  # fmt: skip
    p.add_argument(
        "--retrieve", choices=("locate", "ask"), default="locate",
        help="where a retrieve's extents come from: the LOOKUP that locked the request (locate: "
        "asked for them, as the vLLM scheduler does for its workers; the retrieve is the copy and "
        "the release) or a RETRIEVE round trip of its own (ask)",
    )  # fmt: skip
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--client", type=int, default=0, help=argparse.SUPPRESS)
