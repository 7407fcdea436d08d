"""`kvdepot bench copies`: the sidecar's own copies between an engine's KV blocks and L1
(REGISTER_KV_CACHE, SAVE_BLOCKS, LOAD_BLOCKS) against the client's own `copy_` of the same blocks,
one JSON object.

A sidecar is started (or `--url` used) and this process plays the engine: it allocates KV planes
laid out like vLLM's paged cache (`--device cuda`: GPU tensors shared as CUDA IPC handles, which
the sidecar copies on its own streams; `--device cpu`: a sealed memfd region shared over the
client's lifeline, copied by the sidecar's CPU path), registers them and fills `--chunks` chunks
of blocks with known random bytes (a CPU generator seeded `--seed`: the same bytes on either
device). Each round (`--warmup` untimed, then `--reps`) saves the chunks under new tokens, reads
them back and checks them:

- save: SAVE_BLOCKS of the chunks (the sidecar copies device -> L1) against the baseline, the
  client's `copy_` of the same blocks into a host buffer of the same size (pinned on CUDA, plain
  on CPU), one copy per chunk and plane as the sidecar makes, synchronised;
- load: LOOKUP (untimed), then LOAD_BLOCKS into other blocks, zeroed first, against the baseline
  `copy_` host -> device into the same blocks; every byte loaded is compared with what was saved.

Right after the first round the saved chunks' bytes in L1 are read (RETRIEVE) and compared with the
known bytes; their sha256 is reported. `--check-cpu` (with `--device cuda`) then runs the CPU path
in the same command (a second sidecar that sees no GPU; `--reps 1`) with the same seed and
layout: the chunk bytes in L1 must be identical whichever path wrote them. Ratios are medians over
the timed rounds of each round's own ratio (goal >= 0.8 x); `ok` is correctness only.

`--device cuda` without a usable GPU exits 2 with one line saying what it needs. Needs: torch
(with CUDA for `--device cuda`), and the sidecar's own dependencies.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.sidecar import start_sidecar

if TYPE_CHECKING:  # torch is imported when the benchmark runs, not when the command line is built
    from bench.copies_planes import Planes, Shape

DTYPES = ("bfloat16", "float16", "float32")
GOAL = 0.8
GB = 1e9
BASELINE = "the client's copy_ of the same blocks, one per chunk and plane, to/from a host buffer " + (
    "of the same size (pinned on CUDA), synchronised"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="use a running sidecar at this data-plane URL instead of starting one")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=2048, help="blocks per KV plane")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    p.add_argument("--chunk-tokens", type=int, default=256, help="the sidecar's l1.chunk_size")
    p.add_argument("--chunks", type=int, default=32, help="chunks per SAVE_BLOCKS / LOAD_BLOCKS")
    p.add_argument("--reps", type=int, default=5, help="timed rounds")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--l1-size-gb", type=float, help="the started sidecar's arena (default: two rounds)")
    p.add_argument("--check-cpu", action="store_true", help="also run the CPU path; compare L1 bytes")


def _shape(args: argparse.Namespace) -> Shape:
    from bench.copies_planes import Shape

    shape = Shape(args.layers, args.blocks, args.block_tokens, args.kv_heads, args.head_dim, args.dtype,
                  args.chunk_tokens)  # fmt: skip
    if args.chunk_tokens % args.block_tokens:
        raise SystemExit("kvdepot bench copies: --chunk-tokens must be a multiple of --block-tokens")
    if 2 * args.chunks * shape.blocks_per_chunk > args.blocks:
        raise SystemExit(
            f"kvdepot bench copies: --blocks {args.blocks} is too few for --chunks {args.chunks} "
            f"saved and loaded ({2 * args.chunks * shape.blocks_per_chunk} blocks)"
        )
    return shape


def _l1_gb(args: argparse.Namespace, shape: Shape) -> float:
    if args.l1_size_gb:
        return float(args.l1_size_gb)
    need: float = 2 * args.chunks * shape.chunk_bytes * 1.25 + (64 << 20)
    return math.ceil(need / (1 << 30) * 100) / 100


def _round(client: Any, planes: Planes, args: argparse.Namespace, n: int) -> dict[str, Any]:
    """One round: save under round `n`'s tokens, load into the other blocks, both baselines."""
    shape = planes.shape
    bpc = shape.blocks_per_chunk
    src = list(range(args.chunks * bpc))
    dst = list(range(len(src), 2 * len(src)))
    base = (n + 1) << 24  # each round's tokens are new to L1: every chunk is copied
    tokens = list(range(base, base + args.chunks * args.chunk_tokens))
    save_base = planes.baseline_save(args.chunks, src)
    started = time.perf_counter()
    saved = client.save_blocks(tokens, request_id=f"save-{n}", block_ids=src)
    save_s = time.perf_counter() - started
    hit = client.lookup(tokens, request_id=f"load-{n}").hit_chunks
    load_base = planes.baseline_load(args.chunks, dst)
    planes.clear(dst)
    started = time.perf_counter()
    valid = client.load_blocks(f"load-{n}", first_chunk=0, num_chunks=args.chunks, block_ids=dst)
    load_s = time.perf_counter() - started
    equal = valid and planes.loaded_equal(src, dst)
    nbytes = args.chunks * shape.chunk_bytes
    return {
        "stored": saved.stored, "hit_chunks": hit, "load_valid": valid, "loaded_equal": equal,
        "bytes_verified": nbytes if equal else 0, "tokens": tokens,
        "save_gbps": nbytes / save_s / GB, "save_baseline_gbps": nbytes / save_base / GB,
        "load_gbps": nbytes / load_s / GB, "load_baseline_gbps": nbytes / load_base / GB,
        "save_vs_baseline": save_base / save_s, "load_vs_baseline": load_base / load_s,
    }  # fmt: skip


def _check_l1(client: Any, planes: Planes, tokens: list[int], chunks: int) -> tuple[bool, str]:
    """The saved chunks' bytes in L1 against the known bytes, and their sha256."""
    hit = client.lookup(tokens, request_id="peek").hit_chunks
    if hit != chunks:
        return False, ""
    locked = client.locked("peek", first_chunk=0, num_chunks=chunks)
    try:
        equal, digest = planes.l1_digest(locked.views)
    finally:
        valid = client.release("peek", locked.oids)
    return equal and valid, digest


def _measure(
    args: argparse.Namespace, shape: Shape, device: str, reps: int, url: str | None
) -> dict[str, Any]:
    """One mode end to end against the sidecar at `url`."""
    from bench.copies_planes import Planes
    from kvdepot_connector.client import KVDepotClient
    from kvdepot_connector.protocol import Layout

    layout = Layout(dtype=shape.dtype, num_layers=shape.layers, num_kv_heads=shape.kv_heads,
                    head_dim=shape.head_dim, block_size=shape.block_tokens, kind="vllm-paged",
                    chunk_size=shape.chunk_tokens)  # fmt: skip
    planes = Planes(shape, device, args.chunks)
    try:
        client = KVDepotClient(url or "", model="bench-copies", layout=layout, timeout_s=300).connect()
        try:
            region = planes.region()
            if region is not None:
                client.share([region])
            registered = client.register_kv_cache(planes.handles())
            planes.fill(range(args.chunks * shape.blocks_per_chunk), args.seed)
            rounds = [_round(client, planes, args, 0)]
            # Read back while round 0's chunks are surely in L1 (later rounds may evict them).
            l1_equal, digest = _check_l1(client, planes, rounds[0]["tokens"], args.chunks)
            rounds += [_round(client, planes, args, n) for n in range(1, args.warmup + reps)]
        finally:
            client.close()
    finally:
        planes.close()
    return _summary(args, device, registered, rounds[args.warmup :], l1_equal=l1_equal, digest=digest)


def _summary(
    args: argparse.Namespace, device: str, registered: int, timed: list[dict[str, Any]], *,
    l1_equal: bool, digest: str,
) -> dict[str, Any]:  # fmt: skip
    def med(key: str) -> float:
        return round(float(statistics.median(float(r[key]) for r in timed)), 3)

    correct = all(
        r["stored"] == args.chunks and r["hit_chunks"] == args.chunks and r["loaded_equal"] for r in timed
    )
    out: dict[str, Any] = {"device": device, "registered_planes": registered}
    for key in ("save_gbps", "save_baseline_gbps", "save_vs_baseline", "load_gbps",
                "load_baseline_gbps", "load_vs_baseline"):  # fmt: skip
        out[key] = med(key)
    out["meets_goal"] = out["save_vs_baseline"] >= GOAL and out["load_vs_baseline"] >= GOAL
    out["bytes_verified"] = sum(r["bytes_verified"] for r in timed)
    out["l1_equal"], out["l1_sha256"] = l1_equal, digest
    out["runs"] = [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items() if k != "tokens"}
                   for r in timed]  # fmt: skip
    out["ok"] = correct and l1_equal
    return out


def _sidecar_device(lines: list[str]) -> str:
    """The device the sidecar built its copies on, from its `transfers_ready` log line."""
    for line in lines:
        if '"transfers_ready"' in line:
            return str(json.loads(line).get("device", "unknown"))
    return "unknown"


def _with_sidecar(args: argparse.Namespace, shape: Shape, device: str, reps: int) -> dict[str, Any]:
    """`_measure` against `--url`, or a sidecar started for it (the CPU path's sees no GPU)."""
    if args.url and device == args.device:
        return _measure(args, shape, device, reps, args.url)
    env = {"KVDEPOT_L1__CHUNK_SIZE": str(args.chunk_tokens)}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the sidecar's CPU path, even on a machine with a GPU
    with tempfile.TemporaryDirectory(prefix="kvd-copies-") as tmp:
        sidecar = start_sidecar(Path(tmp), env=env, l1_size_gb=_l1_gb(args, shape))
        try:
            got = _measure(args, shape, device, reps, sidecar.url)
            got["sidecar_device"] = _sidecar_device(sidecar.lines)
            return got
        finally:
            sidecar.stop()


def run(args: argparse.Namespace) -> int:
    from bench.copies_planes import cuda_missing

    if args.device == "cuda":
        missing = cuda_missing()
        if missing is not None:
            print(f"kvdepot bench copies: {missing}", file=sys.stderr)
            return 2
    shape = _shape(args)
    result: dict[str, Any] = {
        "bench": "copies", "goal": f"save and load >= {GOAL} x the baseline", "goal_ratio": GOAL,
        "baseline": BASELINE, "layout": asdict(shape),
        "chunks": args.chunks, "chunk_bytes": shape.chunk_bytes,
        "request_bytes": args.chunks * shape.chunk_bytes,
        "reps": args.reps, "warmup": args.warmup, "seed": args.seed,
    }  # fmt: skip
    if args.device == "cuda":
        import torch

        result["gpu"] = torch.cuda.get_device_name(0)
    result.update(_with_sidecar(args, shape, args.device, args.reps))
    if args.check_cpu and args.device == "cuda":
        cpu = _with_sidecar(args, shape, "cpu", 1)
        same = cpu["l1_sha256"] == result["l1_sha256"] != ""
        result["cpu_check"] = {"ok": cpu["ok"], "l1_sha256": cpu["l1_sha256"], "same_l1_bytes": same,
                               "bytes_verified": cpu["bytes_verified"]}  # fmt: skip
        result["ok"] = result["ok"] and cpu["ok"] and same
    print(json.dumps(result))
    return 0 if result["ok"] else 1
