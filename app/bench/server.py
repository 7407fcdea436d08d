"""`kvdepot bench server`: data-plane store / retrieve / lookup against memcpy, one JSON object.

A sidecar is started (or `--url` used); a client in a separate process stores `--requests`
requests of `--chunks-per-request` chunks, LOOKUPs each right after its STORE (all chunks must
hit), retrieves them into fresh tensors, verifies every byte, and times 16-chunk lookups (token
encoding and server-side hashing included). The baseline is `memcpy_gbps`: torch `copy_` of the
same bytes into preallocated, pre-touched memory, in the same process, measured right before each
request's store and retrieve so that both sides of each ratio see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="use a running sidecar at this data-plane URL instead of starting one")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--chunks-per-request", type=int, default=16)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--lookups", type=int, default=1000, help="lookup samples for the latency figures")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """The client side; runs in its own process."""
    from kvdepot_connector.client import KVDepotClient
    from kvdepot_connector.protocol import Layout

    torch.manual_seed(0)
    layout = Layout(
        dtype=args.dtype, num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
        block_size=args.chunk_tokens, kind="bench", chunk_size=args.chunk_tokens,
    )  # fmt: skip
    chunk_bytes = layout.chunk_bytes
    n_chunks = args.chunks_per_request
    elems = chunk_bytes // torch.tensor([], dtype=DTYPES[args.dtype]).element_size()
    requests = []
    for r in range(args.requests):
        tokens = torch.randint(0, 50_000, (n_chunks * args.chunk_tokens,), dtype=torch.int64).tolist()
        chunks = [torch.randn(elems).to(DTYPES[args.dtype]) for _ in range(n_chunks)]
        requests.append((f"bench-{r}", tokens, chunks))
    outs = [[torch.empty_like(c) for c in chunks] for _, _, chunks in requests]
    for group in outs:
        for t in group:
            t.zero_()  # pre-touch, as the memcpy baseline's destination is
    total = args.requests * n_chunks * chunk_bytes

    def memcpy(chunks: list[torch.Tensor], group: list[torch.Tensor]) -> float:
        """The baseline: the same bytes copied into preallocated memory by torch."""
        start = time.perf_counter()
        for src, dst in zip(chunks, group, strict=True):
            dst.copy_(src)
        elapsed = time.perf_counter() - start
        for t in group:
            t.zero_()
        return elapsed

    # The baseline is measured right before each store and each retrieve of the same request, so
    # both sides of the ratio see the same machine (it is shared and its load drifts).
    ok = True
    memcpy_store_s = memcpy_retrieve_s = 0.0
    with KVDepotClient(args.url, model="bench-model", layout=layout, timeout_s=30) as client:
        store_s = 0.0
        for (rid, tokens, chunks), group in zip(requests, outs, strict=True):
            memcpy_store_s += memcpy(chunks, group)
            start = time.perf_counter()
            outcome = client.store(tokens, chunks, request_id=rid)
            store_s += time.perf_counter() - start
            if outcome.stored != n_chunks:
                ok = False
            hit = client.lookup(tokens, request_id=rid)  # the very next lookup sees the commit
            if hit.hit_chunks != n_chunks:
                ok = False
            client.free_lookup_locks(rid)

        retrieve_s = 0.0
        for (rid, tokens, chunks), group in zip(requests, outs, strict=True):
            memcpy_retrieve_s += memcpy(chunks, group)
            client.lookup(tokens, request_id=rid)
            start = time.perf_counter()
            valid = client.retrieve(rid, group)
            retrieve_s += time.perf_counter() - start
            ok = ok and valid
        for (_, _, chunks), group in zip(requests, outs, strict=True):
            ok = ok and all(
                torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in zip(chunks, group, strict=True)
            )

        rid, tokens, _ = requests[0]
        samples = []
        for _ in range(args.lookups):
            start = time.perf_counter()
            reply = client.lookup(tokens, request_id=rid)
            samples.append(time.perf_counter() - start)
            ok = ok and reply.hit_chunks == n_chunks
        client.end_request(rid)

    return {
        "store_gbps": _gbps(total, store_s),
        "retrieve_gbps": _gbps(total, retrieve_s),
        "memcpy_gbps": _gbps(2 * total, memcpy_store_s + memcpy_retrieve_s),
        "store_vs_memcpy": round(memcpy_store_s / store_s, 3),
        "retrieve_vs_memcpy": round(memcpy_retrieve_s / retrieve_s, 3),
        "lookup_p50_ms": round(_percentile(samples, 0.50) * 1000, 4),
        "lookup_p99_ms": round(_percentile(samples, 0.99) * 1000, 4),
        "lookup_chunks": n_chunks,
        "chunk_bytes": chunk_bytes,
        "chunks": args.requests * n_chunks,
        "requests": args.requests,
        "ok": ok,
    }


def run(args: argparse.Namespace) -> int:
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    from app.bench.sidecar import start_sidecar
    from kvdepot_connector.protocol import Layout

    layout = Layout(
        dtype=args.dtype, num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
        block_size=args.chunk_tokens, kind="bench", chunk_size=args.chunk_tokens,
    )  # fmt: skip
    need = layout.chunk_bytes * args.requests * args.chunks_per_request
    sidecar = None
    with tempfile.TemporaryDirectory(prefix="kvdepot-bench-") as tmp:
        url = args.url
        if url is None:
            size_gb = need * 1.25 / (1 << 30) + 0.0625
            # L1 and the data plane only: write-behind to L2 would compete for the same cores.
            env = {"KVDEPOT_L1__CHUNK_SIZE": str(args.chunk_tokens), "KVDEPOT_L2__ADAPTERS": "[]"}
            sidecar = start_sidecar(Path(tmp), env=env, l1_size_gb=round(size_gb, 3))
            url = sidecar.url
        try:
            cmd = [sys.executable, "-m", "app.cli", "bench", "server", "--worker", "--url", url]
            for name in ("requests", "chunks_per_request", "layers", "kv_heads", "head_dim", "dtype",
                         "chunk_tokens", "lookups"):  # fmt: skip
                cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(done.stderr, file=sys.stderr)
                return done.returncode
            result = json.loads(done.stdout.strip().splitlines()[-1])
        finally:
            if sidecar is not None:
                sidecar.stop()
    result["url"] = "started" if args.url is None else args.url
    print(json.dumps(result))
    return 0 if result["ok"] else 1
