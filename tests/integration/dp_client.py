"""A data-plane client run as its own process by the integration tests.

    python -m tests.integration.dp_client MODE URL CHUNKS [SEED]

MODE reserve-and-hang: STORE (reserve) CHUNKS chunks, print "reserved", then wait to be killed.
MODE lock-and-hang:    store CHUNKS chunks, LOOKUP them (read locks), print "locked", wait.
MODE stall-write:      reserve CHUNKS chunks, print "reserved OFFSET...", wait for a line on stdin
                       (the test stalls the process past its write lease meanwhile), fill every
                       slot with 0x5A bytes, COMMIT, print "committed OK..." (1/0), wait to be killed.
MODE lock-reserve-hang: store CHUNKS chunks, LOOKUP them (read locks), reserve CHUNKS more, print
                       "held LOCKED RESERVED", wait to be killed.
MODE store-retrieve:   4 requests x CHUNKS chunks: store, lookup right after, retrieve, compare;
                       prints one JSON line with the figures.
MODE reserve-then-commit: STORE (reserve) CHUNKS chunks, print "reserved OID...", wait for a
                       line on stdin, fill the slots, COMMIT, print "committed OK..." (1/0 per
                       oid), then lookup and compare: print "identical HIT" (HIT chunks compared).
MODE worker-hold:      as an engine worker (role worker, rank 0): store CHUNKS chunks, LOOKUP them
                       and RETRIEVE (read locks, views kept), reserve CHUNKS//2 more (tokens of
                       SEED+1), print "held LOCKED RESERVED OFFSET...", wait for a line on stdin
                       (the test stalls or kills the process meanwhile), then write 0x5A into its
                       reserved slots, COMMIT, RELEASE the locked request: print "late COMMIT-OKS
                       valid=0|1"; wait for a second line, then a fresh store, lookup and retrieve
                       of 2 chunks of SEED+2: print "fresh STORED HIT identical|different".
MODE flood-heartbeats: connect, print "flooding", then write heartbeat frames to its lifeline as
                       fast as it can (1 MiB per send) until the lifeline breaks or it is killed.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading

import torch

from kvdepot_connector.client import KVDepotClient
from kvdepot_connector.protocol import Layout

CHUNK_TOKENS = 16
LAYOUT = Layout(
    dtype="float16",
    num_layers=8,
    num_kv_heads=2,
    head_dim=64,
    block_size=16,
    kind="test",
    chunk_size=CHUNK_TOKENS,
)  # fmt: skip  (64 KiB per chunk)


def request_tokens(seed: int, chunks: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 60_000, (chunks * CHUNK_TOKENS,), generator=g).tolist()


def chunk_data(seed: int, index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100_003 + index)
    return torch.randn(LAYOUT.chunk_bytes // 2, generator=g).to(torch.float16)


def client(url: str) -> KVDepotClient:
    return KVDepotClient(url, model="test-model", layout=LAYOUT, timeout_s=10).connect()


def main() -> None:
    mode, url, chunks = sys.argv[1], sys.argv[2], int(sys.argv[3])
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    c = client(url)
    toks = request_tokens(seed, chunks)
    if mode == "reserve-and-hang":
        from kvdepot_connector.protocol import SlotStatus

        reply = c.reserve(toks, request_id="hang")
        reserved = sum(s.status is SlotStatus.RESERVED for s in reply.slots)
        print(f"reserved {reserved}", flush=True)
        threading.Event().wait()
    elif mode == "lock-and-hang":
        outcome = c.store(toks, [chunk_data(seed, i) for i in range(chunks)], request_id="w")
        hit = c.lookup(toks, request_id="hang")
        print(f"locked {hit.hit_chunks} stored {outcome.stored}", flush=True)
        threading.Event().wait()
    elif mode == "stall-write":
        from kvdepot_connector.protocol import SlotStatus

        reply = c.reserve(toks, request_id="stalled")
        slots = [s for s in reply.slots if s.status is SlotStatus.RESERVED]
        print("reserved " + " ".join(str(s.offset) for s in slots), flush=True)
        sys.stdin.readline()
        for s in slots:  # late bytes: the lease expired while this process was stopped
            c.slot_view(s).fill_(0x5A)
        ok = c.commit([s.oid for s in slots])
        print("committed " + " ".join(str(int(x)) for x in ok), flush=True)
        threading.Event().wait()
    elif mode == "lock-reserve-hang":
        from kvdepot_connector.protocol import SlotStatus

        c.store(toks, [chunk_data(seed, i) for i in range(chunks)], request_id="w")
        hit = c.lookup(toks, request_id="hang")
        reply = c.reserve(request_tokens(seed + 1, chunks), request_id="hang-w")
        reserved = sum(s.status is SlotStatus.RESERVED for s in reply.slots)
        print(f"held {hit.hit_chunks} {reserved}", flush=True)
        threading.Event().wait()
    elif mode == "store-retrieve":
        result = {"hits_after_store": [], "identical": True, "stored": 0}
        for r in range(4):
            rs = seed + r
            toks = request_tokens(rs, chunks)
            outcome = c.store(toks, [chunk_data(rs, i) for i in range(chunks)], request_id=f"w{r}")
            result["stored"] += outcome.stored
            result["hits_after_store"].append(c.lookup(toks, request_id=f"r{r}").hit_chunks)
        for r in range(4):
            rs = seed + r
            outs = [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16) for _ in range(chunks)]
            valid = c.retrieve(f"r{r}", outs)
            same = all(torch.equal(o, chunk_data(rs, i)) for i, o in enumerate(outs))
            result["identical"] = result["identical"] and valid and same
        print(json.dumps(result), flush=True)
        c.close()
    elif mode == "reserve-then-commit":
        from kvdepot_connector.protocol import SlotStatus

        reply = c.reserve(toks, request_id="slow")
        slots = [s for s in reply.slots if s.status is SlotStatus.RESERVED]
        print("reserved " + " ".join(str(s.oid) for s in slots), flush=True)
        sys.stdin.readline()
        for s in slots:
            c.slot_view(s).copy_(chunk_data(seed, s.chunk).view(torch.uint8))
        ok = c.commit([s.oid for s in slots])
        print("committed " + " ".join(str(int(x)) for x in ok), flush=True)
        hit = c.lookup(toks, request_id="check").hit_chunks
        outs = [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16) for _ in range(hit)]
        valid = c.retrieve("check", outs) if hit else True
        same = valid and all(torch.equal(o, chunk_data(seed, i)) for i, o in enumerate(outs))
        print(f"identical {hit}" if same else "different", flush=True)
        c.close()
    elif mode in ("worker-hold", "flood-heartbeats"):
        c.close()
        (worker_hold if mode == "worker-hold" else flood)(url, chunks, seed)
    else:
        raise SystemExit(f"unknown mode {mode}")


def worker_hold(url: str, chunks: int, seed: int) -> None:
    from kvdepot_connector.protocol import SlotStatus

    c = KVDepotClient(url, model="test-model", layout=LAYOUT, timeout_s=10, role="worker", rank=0).connect()
    toks = request_tokens(seed, chunks)
    c.store(toks, [chunk_data(seed, i) for i in range(chunks)], request_id="w")
    hit = c.lookup(toks, request_id="hold").hit_chunks
    locked = c.locked("hold", first_chunk=0, num_chunks=hit)
    reply = c.reserve(request_tokens(seed + 1, chunks // 2), request_id="hold-w")
    slots = [s for s in reply.slots if s.status is SlotStatus.RESERVED]
    print(f"held {hit} {len(slots)} " + " ".join(str(s.offset) for s in slots), flush=True)
    sys.stdin.readline()
    for s in slots:  # late bytes: the process was stalled past the worker timeout meanwhile
        c.slot_view(s).fill_(0x5A)
    ok = c.commit([s.oid for s in slots])
    valid = c.release("hold", locked.oids, fences=locked.fences)  # moved: it must ask
    print("late " + " ".join(str(int(x)) for x in ok) + f" valid={int(valid)}", flush=True)
    sys.stdin.readline()
    fresh = request_tokens(seed + 2, 2)
    stored = c.store(fresh, [chunk_data(seed + 2, i) for i in range(2)], request_id="fresh-w").stored
    hit = c.lookup(fresh, request_id="fresh").hit_chunks
    outs = [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16) for _ in range(hit)]
    valid = c.retrieve("fresh", outs) if hit else False
    same = valid and all(torch.equal(o, chunk_data(seed + 2, i)) for i, o in enumerate(outs))
    print(f"fresh {stored} {hit} " + ("identical" if same else "different"), flush=True)
    threading.Event().wait()


def flood(url: str, _chunks: int, _seed: int) -> None:
    from kvdepot_connector.lifeline import Heartbeat, encode_frame

    c = KVDepotClient(url, model="test-model", layout=LAYOUT, timeout_s=10, role="worker", rank=1).connect()
    session = c._session  # the attacker writes to its own lifeline directly, without its own thread
    session._stop_heartbeats()
    line = session.lifeline
    assert line is not None
    burst = encode_frame(Heartbeat(seq=1)) * ((1 << 20) // len(encode_frame(Heartbeat(seq=1))))
    sock = socket.socket(fileno=os.dup(line.fileno()))
    sock.settimeout(None)
    print("flooding", flush=True)
    try:
        while True:
            sock.sendall(burst)
    except OSError as exc:
        print(f"broken {exc.__class__.__name__}", flush=True)


if __name__ == "__main__":
    main()
