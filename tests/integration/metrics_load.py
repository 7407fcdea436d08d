"""Traffic that makes a real sidecar export every labelled metric series, run as its own process
(a real connector client over the data plane) by the metric catalog and Prometheus tests.

    python -m tests.integration.metrics_load URL ROUNDS [SECONDS [PAUSE]]

Each round, for every tenant in TENANTS: store a fresh 4-chunk sequence (new tokens each round,
so a small L1 evicts), look it up and retrieve it (L1 hits); for L2_TENANT, clear its L1 and look up
the previous round's sequence waiting for the L2 prefetch (L2 hits and loads); look up tokens never
stored (misses), ask for a request id that does not exist (a data-plane error reply), and open and
close a second client (a worker that dies); then sleep PAUSE seconds (0). Stops after ROUNDS
rounds or SECONDS seconds, whichever comes first, and prints one JSON line with what it did.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from kvdepot_connector.client import KVDepotClient
from kvdepot_connector.errors import SidecarError
from tests.integration.dp_client import CHUNK_TOKENS, LAYOUT, chunk_data, client, request_tokens

TENANTS = ("", "acme", "tiny")
L2_TENANT = "acme"
L2_TRIES = 20
CHUNKS = 4


def fetch(c: KVDepotClient, rid: str, hit: int) -> int:
    """Retrieve the `hit` chunks a lookup locked (or end the request when there are none)."""
    if hit:
        c.retrieve(rid, [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16) for _ in range(hit)])
    else:
        c.end_request(rid)
    return hit


def read_from_l2(c: KVDepotClient, salt: str, toks: list[int], rid: str) -> int:
    """Clear the tenant's L1, look `toks` up waiting for the L2 prefetch and retrieve the hits;
    tried again a few times while the write-behind of those chunks may still be under way."""
    for attempt in range(L2_TRIES):
        c.clear(salt)
        hit = c.lookup(toks, request_id=f"{rid}-{attempt}", cache_salt=salt, wait=True).hit_chunks
        if hit or attempt == L2_TRIES - 1:
            return fetch(c, f"{rid}-{attempt}", hit)
        c.end_request(f"{rid}-{attempt}")
        time.sleep(0.05)
    return 0


def one_round(c: KVDepotClient, url: str, r: int, totals: dict[str, int]) -> None:
    for t, salt in enumerate(TENANTS):
        seed = 10_000 * (t + 1) + r
        toks = request_tokens(seed, CHUNKS)
        outcome = c.store(toks, [chunk_data(seed, i) for i in range(CHUNKS)], request_id=f"w{r}{t}",
                          cache_salt=salt)  # fmt: skip
        totals["stored"] += outcome.stored
        hit = c.lookup(toks, request_id=f"r{r}{t}", cache_salt=salt).hit_chunks
        totals["hits_l1"] += fetch(c, f"r{r}{t}", hit)
        if r and salt == L2_TENANT:  # the previous round's sequence, dropped from L1: hits from L2
            totals["hits_l2"] += read_from_l2(c, salt, request_tokens(seed - 1, CHUNKS), f"p{r}{t}")
        miss = c.lookup(request_tokens(seed + 7_777_777, 2)[: 2 * CHUNK_TOKENS], request_id=f"m{r}{t}",
                        cache_salt=salt)  # fmt: skip
        totals["misses"] += 2 - miss.hit_chunks
        c.end_request(f"m{r}{t}")
    try:
        c.retrieve("no-such-request", [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16)])
    except SidecarError:
        totals["errors"] += 1
    client(url).close()  # a worker that comes and goes: dead once its lifeline closes
    totals["rounds"] += 1


def main() -> None:
    url, rounds = sys.argv[1], int(sys.argv[2])
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 600.0
    pause = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    deadline = time.monotonic() + seconds
    totals = {"rounds": 0, "stored": 0, "hits_l1": 0, "hits_l2": 0, "misses": 0, "errors": 0}
    c = client(url)
    r = 0
    while r < rounds and time.monotonic() < deadline:
        one_round(c, url, r, totals)
        r += 1
        time.sleep(pause)
    c.close()
    print(json.dumps(totals), flush=True)


if __name__ == "__main__":
    main()
