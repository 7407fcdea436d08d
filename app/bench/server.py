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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from app.bench.sidecar import SidecarProcess
    from kvdepot_connector.client import KVDepotClient
    from kvdepot_connector.protocol import Layout

DTYPES = ("bfloat16", "float16", "float32")  # torch's names; torch is imported by the client only


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="use a running sidecar at this data-plane URL instead of starting one")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--chunks-per-request", type=int, default=16)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=DTYPES, default="float16")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--lookups", type=int, default=1000, help="lookup samples for the latency figures")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _layout(args: argparse.Namespace) -> Layout:
    from kvdepot_connector.protocol import Layout

    return Layout(
        dtype=args.dtype, num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
        block_size=args.chunk_tokens, kind="bench", chunk_size=args.chunk_tokens,
    )  # fmt: skip


@dataclass
class _Request:
    """One request's tokens, its chunks, and the preallocated, pre-touched memory they come back to."""

    rid: str
    tokens: list[int]
    chunks: list[torch.Tensor]
    out: list[torch.Tensor]

    def memcpy(self) -> float:
        """The baseline: the same bytes copied into the preallocated memory by torch."""
        start = time.perf_counter()
        for src, dst in zip(self.chunks, self.out, strict=True):
            dst.copy_(src)
        elapsed = time.perf_counter() - start
        for t in self.out:
            t.zero_()
        return elapsed

    def identical(self) -> bool:
        import torch

        return all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for a, b in zip(self.chunks, self.out, strict=True)
        )


@dataclass
class _Timings:
    store_s: float = 0.0
    retrieve_s: float = 0.0
    memcpy_store_s: float = 0.0
    memcpy_retrieve_s: float = 0.0
    lookups: list[float] = field(default_factory=list)
    ok: bool = True


def _make_requests(args: argparse.Namespace, chunk_bytes: int) -> list[_Request]:
    import torch

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    elems = chunk_bytes // torch.tensor([], dtype=dtype).element_size()
    requests = []
    for r in range(args.requests):
        tokens = torch.randint(0, 50_000, (args.chunks_per_request * args.chunk_tokens,), dtype=torch.int64)
        chunks = [torch.randn(elems).to(dtype) for _ in range(args.chunks_per_request)]
        out = [torch.zeros_like(c) for c in chunks]  # pre-touched, as the memcpy baseline's destination is
        requests.append(_Request(f"bench-{r}", tokens.tolist(), chunks, out))
    return requests


# The baseline is measured right before each store and each retrieve of the same request, so both
# sides of the ratio see the same machine (it is shared and its load drifts).


def _store_all(client: KVDepotClient, requests: list[_Request], t: _Timings) -> None:
    for req in requests:
        t.memcpy_store_s += req.memcpy()
        start = time.perf_counter()
        outcome = client.store(req.tokens, req.chunks, request_id=req.rid)
        t.store_s += time.perf_counter() - start
        if outcome.stored != len(req.chunks):
            t.ok = False
        hit = client.lookup(req.tokens, request_id=req.rid)  # the very next lookup sees the commit
        if hit.hit_chunks != len(req.chunks):
            t.ok = False
        client.free_lookup_locks(req.rid)


def _retrieve_all(client: KVDepotClient, requests: list[_Request], t: _Timings) -> None:
    for req in requests:
        t.memcpy_retrieve_s += req.memcpy()
        client.lookup(req.tokens, request_id=req.rid)
        start = time.perf_counter()
        valid = client.retrieve(req.rid, req.out)
        t.retrieve_s += time.perf_counter() - start
        t.ok = t.ok and valid
    for req in requests:
        t.ok = t.ok and req.identical()


def _time_lookups(client: KVDepotClient, req: _Request, samples: int, t: _Timings) -> None:
    for _ in range(samples):
        start = time.perf_counter()
        reply = client.lookup(req.tokens, request_id=req.rid)
        t.lookups.append(time.perf_counter() - start)
        t.ok = t.ok and reply.hit_chunks == len(req.chunks)
    client.end_request(req.rid)


def _figures(args: argparse.Namespace, chunk_bytes: int, t: _Timings) -> dict[str, Any]:
    total = args.requests * args.chunks_per_request * chunk_bytes
    return {
        "store_gbps": _gbps(total, t.store_s),
        "retrieve_gbps": _gbps(total, t.retrieve_s),
        "memcpy_gbps": _gbps(2 * total, t.memcpy_store_s + t.memcpy_retrieve_s),
        "store_vs_memcpy": round(t.memcpy_store_s / t.store_s, 3),
        "retrieve_vs_memcpy": round(t.memcpy_retrieve_s / t.retrieve_s, 3),
        "lookup_p50_ms": round(_percentile(t.lookups, 0.50) * 1000, 4),
        "lookup_p99_ms": round(_percentile(t.lookups, 0.99) * 1000, 4),
        "lookup_chunks": args.chunks_per_request,
        "chunk_bytes": chunk_bytes,
        "chunks": args.requests * args.chunks_per_request,
        "requests": args.requests,
        "ok": t.ok,
    }


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """The client side; runs in its own process."""
    from kvdepot_connector.client import KVDepotClient

    layout = _layout(args)
    requests = _make_requests(args, layout.chunk_bytes)
    t = _Timings()
    with KVDepotClient(args.url, model="bench-model", layout=layout, timeout_s=30) as client:
        _store_all(client, requests, t)
        _retrieve_all(client, requests, t)
        _time_lookups(client, requests[0], args.lookups, t)
    return _figures(args, layout.chunk_bytes, t)


def _start_sidecar(args: argparse.Namespace, tmp: Path) -> SidecarProcess:
    """A sidecar with an L1 big enough for every request, and no L2."""
    from app.bench.sidecar import start_sidecar

    need = _layout(args).chunk_bytes * args.requests * args.chunks_per_request
    size_gb = need * 1.25 / (1 << 30) + 0.0625
    # L1 and the data plane only: write-behind to L2 would compete for the same cores.
    env = {"KVDEPOT_L1__CHUNK_SIZE": str(args.chunk_tokens), "KVDEPOT_L2__ADAPTERS": "[]"}
    return start_sidecar(tmp, env=env, l1_size_gb=round(size_gb, 3))


def _run_worker(args: argparse.Namespace, url: str) -> dict[str, Any] | int:
    """The worker's JSON object, or its exit status when it failed (its stderr is printed)."""
    cmd = [sys.executable, "-m", "app.cli", "bench", "server", "--worker", "--url", url]
    for name in ("requests", "chunks_per_request", "layers", "kv_heads", "head_dim", "dtype",
                 "chunk_tokens", "lookups"):  # fmt: skip
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr)
        return done.returncode
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run(args: argparse.Namespace) -> int:
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    with tempfile.TemporaryDirectory(prefix="kvdepot-bench-") as tmp:
        sidecar = None if args.url is not None else _start_sidecar(args, Path(tmp))
        try:
            result = _run_worker(args, args.url if sidecar is None else sidecar.url)
        finally:
            if sidecar is not None:
                sidecar.stop()
    if isinstance(result, int):
        return result
    result["url"] = "started" if args.url is None else args.url
    print(json.dumps(result))
    return 0 if result["ok"] else 1
