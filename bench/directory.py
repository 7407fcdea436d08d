"""`kvdepot bench directory`: the directory's index at scale, in one process, one core.

One JSON object:
- `score_p50_ms` / `score_p99_ms`: `Scorer.score` of a `--tokens`-token request (salted, 16
  instances holding prefixes of it of different lengths in L1, local L2 and a shared tier) against
  an index of `--chunks` chunks spread over `--instances` instances; from the token ids to the
  ranked answer (hashing included; HTTP parsing not). Baseline in the same run: hashing the same
  tokens into chunk keys alone (`TokenHasher.chunk_hashes`, what a sidecar does per lookup):
  `score_vs_hashing_p50`. Beside the wall times, to tell the code's cost from the machine's:
  `score_cpu_p50_ms` / `score_cpu_p99_ms`, the thread CPU time of the same calls, and
  `score_preempted_share`, the share of those calls during which the thread was switched out for
  another process (involuntary context switches).
- `ingest_events_per_s`: real KVEventBatch msgpack bytes (the sidecar's encoder: 64 events a batch,
  each a chunk of `--chunk-size` tokens as `chunk-size / block-size` block hashes with token ids,
  parent, tenant extra keys; 3 stores to 1 removal) decoded and applied to the populated index.
  Baseline: decoding the same bytes with the full wire structs (what any consumer pays):
  `ingest_vs_full_decode`. `ingest_with_match_events_per_s`: the same with the non-prefix
  matcher on (token ids decoded, every store fingerprinted into its scope's table).
- `rebuild_s`: the whole index rebuilt from inventory NDJSON lines (the sidecar's format, pages of
  256 lines per instance) into a fresh directory: the time in the reader only (the lines are
  generated page by page beside it, untimed).
- `rss_mb_per_million_chunks`: resident memory grown by the populated index, per million chunks.
`ok`: the figures are sane (every instance scored, the longest prefix found where it was put, the
index holds what was listed).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import sys
import time
from typing import Any

import msgspec
import numpy as np

from api.kvevents.wire import BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch
from engine.keys import KVLayout, TokenHasher
from fleet.directory import Directory
from fleet.hashing import TenantNamer, first_blocks, seed_of
from fleet.ingest import InventoryReader, apply_batch, batch_decoder, batch_tokens_decoder
from fleet.match import Matchers
from fleet.spec import DirectoryConfig, InstanceSpec, NamespaceSpec, TierSpec
from kvdepot_connector.protocol import encode_tokens

MODEL = "bench-model"
SALT = "tenant-a"
SHARED = "ab" * 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chunks", type=int, default=1_000_000, help="chunks indexed")
    p.add_argument("--instances", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32768, help="tokens of the scored request")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--scores", type=int, default=2000, help="score calls timed")
    p.add_argument("--events", type=int, default=200_000, help="chunk events ingested")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * 4096 / (1 << 20)


def _involuntary_switches() -> int:
    """Times this thread was switched out for another runnable one (Linux; 0 elsewhere)."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    return resource.getrusage(who).ru_nivcsw if who is not None else 0


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


def _specs(n: int, layout: KVLayout) -> list[InstanceSpec]:
    ns = NamespaceSpec(
        model=MODEL, layout_fp=layout.fingerprint.hex(), block_size=layout.block_size,
        chunk_size=layout.chunk_size,
    )  # fmt: skip
    tiers = [TierSpec(medium="DISK"), TierSpec(medium="REDIS", shared=SHARED)]
    return [
        InstanceSpec(
            id=f"i{i:02d}",
            url=f"http://10.0.0.{i}:8080",
            events_endpoint=f"tcp://10.0.0.{i}:5557",
            namespaces=[ns],
            salt_mode="plain",
            tiers=tiers,
            queue_depth=i,
        )
        for i in range(n)
    ]


def _directory(specs: list[InstanceSpec]) -> Directory:
    d = Directory(DirectoryConfig(max_instances=max(len(specs), 1)), None, None)
    for spec in specs:
        d.registry.register(spec, 0.0, static=True)
    return d


def _populate(d: Directory, heads: list[int], chunks: int, seed: int) -> int:
    """The request's chunks held by instance i up to a length of its own, then random filler."""
    reg = d.registry
    insts = list(reg.instances.values())
    index = d.index
    n = len(heads)
    for i, inst in enumerate(insts):
        upto = n * (i + 1) // len(insts)
        medium = ("CPU", "DISK", "REDIS")[i % 3]
        bit = reg.holder_bit(inst, medium)
        index.add_many(bit, heads[:upto])
    rng = np.random.default_rng(seed)
    filler = chunks - len(index)
    keys = rng.integers(0, 2**63 - 1, size=filler, dtype=np.int64).tolist()
    owners = rng.integers(0, len(insts), size=filler).tolist()
    bits = [reg.holder_bit(inst, "CPU") for inst in insts]
    masks = index.masks
    for h, o in zip(keys, owners, strict=True):
        masks[h] = masks.get(h, 0) | (1 << bits[o])
    for b in bits:
        index.counts[b] += filler // len(bits)
    return len(index)


def _batches(events: int, layout: KVLayout, tokens_per_chunk: int) -> list[bytes]:
    rng = random.Random(7)
    blocks = layout.chunk_size // layout.block_size
    out: list[bytes] = []
    made = 0
    toks = [rng.randrange(0, 150_000) for _ in range(tokens_per_chunk)]
    extra = [("0123456789abcdef" * 2,)] * blocks
    while made < events:
        evs: list[Any] = []
        for _ in range(min(64, events - made)):
            hashes = [rng.getrandbits(64) for _ in range(blocks)]
            if made % 4 == 3:
                evs.append(BlockRemoved(block_hashes=hashes, medium="CPU"))
            else:
                evs.append(
                    BlockStored(
                        block_hashes=hashes,
                        parent_block_hash=rng.getrandbits(64),
                        token_ids=toks,
                        block_size=layout.block_size,
                        lora_id=None,
                        medium="CPU",
                        lora_name=None,
                        extra_keys=extra,  # type: ignore[arg-type]
                    )
                )
            made += 1
        out.append(encode_batch(KVEventBatch(ts=time.time(), events=evs)))
    return out


def _pages(count: int, layout: KVLayout, seed: int) -> Any:
    rng = np.random.default_rng(seed)
    blocks = layout.chunk_size // layout.block_size
    enc = msgspec.json.encode
    left = count
    while left:
        n = min(256, left)
        hashes = rng.integers(0, 2**63 - 1, size=(n, blocks), dtype=np.int64).tolist()
        yield [
            enc({"kind": "chunk", "medium": "CPU", "model": MODEL, "block_size": layout.block_size,
                 "block_hashes": h})
            for h in hashes
        ]  # fmt: skip
        left -= n


def run(args: argparse.Namespace) -> int:
    layout = KVLayout("bfloat16", 32, 8, 128, args.block_size, "bench", args.chunk_size)
    specs = _specs(args.instances, layout)
    rng = random.Random(1)
    tokens = [rng.randrange(0, 150_000) for _ in range(args.tokens)]
    seed = seed_of(MODEL, layout.fingerprint, 0, 0, TenantNamer(None).tenant(SALT, "plain"))
    heads = first_blocks(encode_tokens(tokens), args.chunk_size, seed)

    gc.collect()
    rss0 = _rss_mb()
    d = _directory(specs)
    indexed = _populate(d, heads, args.chunks, 11)
    gc.collect()
    rss_per_m = (_rss_mb() - rss0) / indexed * 1e6
    gc.freeze()  # as a long-running process's start-up objects: out of the collector's passes

    # scores, against hashing alone (alternating); each score's thread CPU time and whether the
    # thread was switched out meanwhile (other processes on the machine) beside its wall time
    hasher = TokenHasher(args.chunk_size)
    score_ms: list[float] = []
    score_cpu_ms: list[float] = []
    preempted = 0
    hash_ms: list[float] = []
    answer = d.scorer.score(MODEL, tokens, SALT, None, 1.0)
    for _ in range(args.scores):
        switches = _involuntary_switches()
        c0 = time.thread_time()
        t0 = time.perf_counter()
        d.scorer.score(MODEL, tokens, SALT, None, 1.0)
        t1 = time.perf_counter()
        c1 = time.thread_time()
        preempted += _involuntary_switches() > switches
        t2 = time.perf_counter()
        hasher.chunk_hashes(encode_tokens(tokens))
        t3 = time.perf_counter()
        score_ms.append((t1 - t0) * 1000)
        score_cpu_ms.append((c1 - c0) * 1000)
        hash_ms.append((t3 - t2) * 1000)
    n_chunks = len(heads)
    upto = [n_chunks * (i + 1) // args.instances for i in range(args.instances)]
    shared = max((u for i, u in enumerate(upto) if i % 3 == 2), default=0)  # counts for every one
    expected = {f"i{i:02d}": max(u, shared) * args.chunk_size for i, u in enumerate(upto)}
    got = {s.id: s.prefix_tokens for s in answer.instances}

    # ingest: real batches into the populated index
    payloads = _batches(args.events, layout, args.chunk_size)
    inst = d.registry.get("i00")
    assert inst is not None
    t0 = time.perf_counter()
    applied = 0
    for payload in payloads:
        chunks, _ = apply_batch(d.registry, inst, batch_decoder.decode(payload), d.lora)
        applied += chunks
    ingest_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for payload in payloads:
        decode_batch(payload)
    full_decode_s = time.perf_counter() - t0
    matchers = Matchers()  # the same batches with the non-prefix matcher on (directory.match)
    t0 = time.perf_counter()
    for payload in payloads:
        apply_batch(d.registry, inst, batch_tokens_decoder.decode(payload), d.lora, matchers)
    match_ingest_s = time.perf_counter() - t0
    learnt = matchers.totals()["learnt"]
    del payloads

    # rebuild from inventory lines into a fresh directory
    del d
    gc.collect()
    fresh = _directory(specs)
    per_inst = args.chunks // args.instances
    rebuild_s = 0.0
    for i, inst_id in enumerate(sorted(fresh.registry.instances)):
        inst = fresh.registry.instances[inst_id]
        reader = InventoryReader(fresh.registry, inst)
        header = json.dumps({"kind": "header", "incarnation": "x", "seq": 5, "salt": "plain"})
        t0 = time.perf_counter()
        reader.feed(header)
        rebuild_s += time.perf_counter() - t0
        for page in _pages(per_inst, layout, 100 + i):
            t0 = time.perf_counter()
            reader.feed_page(page)
            rebuild_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        reader.feed(json.dumps({"kind": "end", "chunks": per_inst}))
        done = reader.finish()
        rebuild_s += time.perf_counter() - t0
        assert done == ("x", 5)
    rebuilt = len(fresh.index)

    stores = args.events - args.events // 4
    ok = got == expected and applied == args.events and rebuilt == per_inst * args.instances
    ok = ok and learnt == stores
    result = {
        "chunks_indexed": indexed, "instances": args.instances, "request_tokens": args.tokens,
        "chunk_size": args.chunk_size,
        "score_p50_ms": round(_pct(score_ms, 50), 4), "score_p99_ms": round(_pct(score_ms, 99), 4),
        "score_cpu_p50_ms": round(_pct(score_cpu_ms, 50), 4),
        "score_cpu_p99_ms": round(_pct(score_cpu_ms, 99), 4),
        "score_preempted_share": round(preempted / max(args.scores, 1), 4),
        "hashing_p50_ms": round(_pct(hash_ms, 50), 4), "hashing_p99_ms": round(_pct(hash_ms, 99), 4),
        "score_vs_hashing_p50": round(_pct(score_ms, 50) / max(_pct(hash_ms, 50), 1e-9), 3),
        "ingest_events_per_s": round(applied / ingest_s),
        "full_decode_events_per_s": round(applied / full_decode_s),
        "ingest_vs_full_decode": round(full_decode_s / ingest_s, 3),
        "ingest_with_match_events_per_s": round(applied / match_ingest_s),
        "rebuild_s": round(rebuild_s, 3), "rebuilt_chunks": rebuilt,
        "rss_mb_per_million_chunks": round(rss_per_m, 1),
        "best": answer.instances[0].id if answer.instances else None, "ok": ok,
    }  # fmt: skip
    if not ok:
        result["prefixes"] = got
        result["expected"] = expected
    print(json.dumps(result))
    sys.stdout.flush()
    return 0 if ok else 1
