"""The client process of `kvdepot bench server`: one engine's requests, driven step by step.

`kvdepot bench server` (bench/server.py) starts one of these per client (`--worker`). Each
builds its own requests (random tokens and random chunk bytes from its own seed, so no two
clients share a chunk; the memory they come back to is preallocated and touched), connects its
own `KVDepotClient`, says `{"ready": ...}` on stdout, then runs the steps the parent writes to its
stdin, one JSON object a line, and answers each with one line:

  {"op": "memcpy", "r": i, "start": t}    the retrieve's baseline: request i's chunks memmoved
                                          into its output memory (then zeroed, untimed)
  {"op": "memcpy_cold", "r": i,           the store's baseline: request i's chunks memmoved into
   "start": t}                            memory as cold as the arena's extents a store writes:
                                          the next of three request-sized buffers, each last
                                          written three requests ago (more than the CPU's last-
                                          level cache since), not the output memory the previous
                                          step just zeroed (a destination in cache: half the time)
  {"op": "store", "r": i, "start": t}     STORE + copies + COMMIT of request i; then, untimed, a
                                          LOOKUP that must hit every chunk
  {"op": "lock", "r": i}                  LOOKUP of request i (read locks for the retrieve)
  {"op": "retrieve", "r": i, "start": t}  RETRIEVE + copies + RELEASE into the output memory
  {"op": "clear"}                         the client's chunks cleared (CLEAR of its cache salt;
                                          the segments its stores were given stay its own)
  {"op": "verify"}                        every retrieved byte against what was stored
  {"op": "ping", "samples": n,            round trips of a PING (the per-call overhead), back to
   "after_copy": m}                       back, and m more each right after a memmove of request
                                          0's chunks (the caches as a call after a copy finds them)
  {"op": "lookups", "samples": n}         latency of LOOKUPs of request 0 (token encoding included)
  {"op": "prompt", "tokens": T, ...}      latency of LOOKUPs of a T-token prompt (hashing included)
                                          and of the server's hash chain of the same tokens alone
  {"op": "exit"}                          the worker's chunks are cleared and it leaves

Timed steps wait until `start` (a CLOCK_MONOTONIC time, the same in every process), so that the
parent can run them in all clients at once, and answer with `begin` and `end`: the parent's
aggregate is the bytes of all clients over the span from the first `begin` to the last `end`.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvdepot_connector.client import KVDepotClient
from kvdepot_connector.protocol import Layout, LookupReply, SlotStatus, encode_tokens


@dataclass
class Request:
    rid: str
    tokens: bytes
    chunks: list[torch.Tensor]
    outs: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(c.numel() for c in self.chunks)

    def memcpy(self, into: list[torch.Tensor] | None = None) -> None:
        for src, dst in zip(self.chunks, self.outs if into is None else into, strict=True):
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())

    def zero(self) -> None:
        for t in self.outs:
            t.zero_()

    def verified_bytes(self) -> int:
        """Bytes that came back as they were stored (all of them, or the request counts none)."""
        same = all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(self.chunks, self.outs, strict=True))
        return self.nbytes if same else 0


def make_requests(
    seed: int, *, requests: int, chunks: int, chunk_bytes: int, chunk_tokens: int
) -> list[Request]:
    rng = np.random.default_rng(seed)
    out = []
    for r in range(requests):
        tokens = rng.integers(0, 50_000, chunks * chunk_tokens, dtype=np.uint32)
        data = [torch.from_numpy(np.frombuffer(rng.bytes(chunk_bytes), dtype=np.uint8).copy())
                for _ in range(chunks)]  # fmt: skip
        outs = [torch.ones(chunk_bytes, dtype=torch.uint8) for _ in range(chunks)]  # pages touched
        out.append(Request(f"bench-{seed}-{r}", tokens.astype("<u4").tobytes(), data, outs))
    for req in out:
        req.zero()
    return out


def _percentile_ms(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 4)


def _wait(start: float) -> float:
    delay = start - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    return time.monotonic()


class Worker:
    def __init__(self, args: Any) -> None:
        self.args = args
        self.layout = Layout(
            dtype=args.dtype, num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
            block_size=args.chunk_tokens, kind="bench", chunk_size=args.chunk_tokens,
        )  # fmt: skip
        self.salt = f"bench-client-{args.client}"
        self.requests = make_requests(
            args.client, requests=args.requests, chunks=args.chunks_per_request,
            chunk_bytes=self.layout.chunk_bytes, chunk_tokens=args.chunk_tokens,
        )  # fmt: skip
        # the store baseline's destinations (touched): three, used in turn
        self.cold = [[torch.ones_like(c) for c in self.requests[0].chunks] for _ in range(3)]
        self.client = KVDepotClient(args.url, model="bench-model", layout=self.layout, timeout_s=30).connect()
        self.located: LookupReply | None = None  # the last "lock" step's LOOKUP reply

    def step(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        c = self.client
        if op in ("memcpy", "memcpy_cold", "store", "retrieve"):
            req = self.requests[cmd["r"]]
            begin = _wait(cmd["start"])
            if op == "memcpy":
                req.memcpy()
                end = time.monotonic()
                req.zero()
                return {"begin": begin, "end": end, "ok": True}
            if op == "memcpy_cold":
                req.memcpy(self.cold[cmd["r"] % len(self.cold)])
                return {"begin": begin, "end": time.monotonic(), "ok": True}
            if op == "store":
                stored, phases = self._store(req)
                end = time.monotonic()
                hit = c.lookup(req.tokens, request_id=req.rid, cache_salt=self.salt).hit_chunks
                c.free_lookup_locks(req.rid)
                # the LOOKUP read a posted COMMIT's answer first: a refused chunk is counted by now
                ok = stored == len(req.chunks) and hit == len(req.chunks) and c.commits_refused == 0
                return {"begin": begin, "end": end, "ok": ok, "phases": phases}
            valid, phases = self._retrieve(req)
            return {"begin": begin, "end": time.monotonic(), "ok": valid, "phases": phases}
        if op == "lock":  # the scheduler's LOOKUP, untimed; with --retrieve locate it names the extents
            req = self.requests[cmd["r"]]
            self.located = c.lookup(req.tokens, request_id=req.rid, cache_salt=self.salt,
                                    extents=self.args.retrieve == "locate")  # fmt: skip
            return {"ok": self.located.hit_chunks == len(req.chunks)}
        if op == "clear":  # this client's chunks go; its write domain's segments stay its own
            c.clear(self.salt)
            return {"ok": all(c.lookup(r.tokens, request_id=r.rid, cache_salt=self.salt).hit_chunks == 0
                              and c.end_request(r.rid) >= 0 for r in self.requests)}  # fmt: skip
        if op == "verify":
            verified = sum(req.verified_bytes() for req in self.requests)
            total = sum(req.nbytes for req in self.requests)
            return {"ok": verified == total, "bytes_verified": verified}
        if op == "ping":
            times, after = [], []
            for _ in range(cmd["samples"]):
                start = time.perf_counter()
                c.ping()
                times.append(time.perf_counter() - start)
            req = self.requests[0]
            for _ in range(cmd.get("after_copy", 0)):
                req.memcpy()
                start = time.perf_counter()
                c.ping()
                after.append(time.perf_counter() - start)
            req.zero()
            return {
                "p50_ms": _percentile_ms(times, 0.5), "p99_ms": _percentile_ms(times, 0.99),
                "after_copy_p50_ms": _percentile_ms(after, 0.5) if after else None,
            }  # fmt: skip
        if op == "lookups":
            return self._lookups(cmd["samples"])
        if op == "prompt":
            return self._prompt(cmd["tokens"], cmd["samples"])
        raise ValueError(f"unknown step {op!r}")

    def _store(self, req: Request) -> tuple[int, dict[str, float]]:
        """`KVDepotClient.store`'s three steps through its public calls (reserve, one memmove into
        each slot as `store` does, commit), each timed: where a store's time goes beyond the copy.
        Returns (chunks stored, seconds per step)."""
        c = self.client
        t0 = time.perf_counter()
        reply = c.reserve(req.tokens, request_id=req.rid, cache_salt=self.salt)
        t1 = time.perf_counter()
        oids = []
        for slot in reply.slots:
            if slot.status is SlotStatus.RESERVED:
                src = req.chunks[slot.chunk]
                ctypes.memmove(c.slot_view(slot).data_ptr(), src.data_ptr(), slot.size)
                oids.append(slot.oid)
        t2 = time.perf_counter()
        committed = c.commit(oids, wait=self.args.commit == "wait")
        t3 = time.perf_counter()
        stored = sum(committed)
        return stored, {"reserve": t1 - t0, "copy_in": t2 - t1, "commit": t3 - t2}

    def _retrieve(self, req: Request) -> tuple[bool, dict[str, float]]:
        """`KVDepotClient.retrieve`'s three steps through its public calls (`extents`: the RETRIEVE
        round trip naming the locked extents, or with --retrieve locate their views made from the
        LOOKUP's reply; one memmove out of each, as `retrieve` does; the release), each timed.
        Returns (copy valid, seconds per step)."""
        c = self.client
        t0 = time.perf_counter()
        n = len(req.outs)
        if self.args.retrieve == "locate":
            assert self.located is not None
            locked = c.locked_from(self.located, first_chunk=0, num_chunks=n)
        else:
            locked = c.locked(req.rid, first_chunk=0, num_chunks=n)
        t1 = time.perf_counter()
        for view, dst in zip(locked.views, req.outs, strict=True):
            ctypes.memmove(dst.data_ptr(), view.data_ptr(), view.numel())
        t2 = time.perf_counter()
        valid = c.release(req.rid, locked.oids, fences=locked.fences, epoch=locked.epoch)
        t3 = time.perf_counter()
        return valid, {"extents": t1 - t0, "copy_out": t2 - t1, "release": t3 - t2}

    def _lookups(self, samples: int) -> dict[str, Any]:
        """LOOKUPs of request 0 as its token list (the client encodes the tokens each time)."""
        req = self.requests[0]
        tokens = np.frombuffer(req.tokens, dtype="<u4").tolist()
        times = []
        ok = True
        for _ in range(samples):
            start = time.perf_counter()
            reply = self.client.lookup(tokens, request_id=req.rid, cache_salt=self.salt)
            times.append(time.perf_counter() - start)
            ok = ok and reply.hit_chunks == len(req.chunks)
        self.client.end_request(req.rid)
        return {"p50_ms": _percentile_ms(times, 0.5), "p99_ms": _percentile_ms(times, 0.99), "ok": ok}

    def _prompt(self, tokens: int, samples: int) -> dict[str, Any]:
        """A `tokens`-token prompt, stored with a small layout of its own (the bytes of a chunk do not
        change a lookup), then looked up `samples` times as the connector sends it: its wire bytes,
        encoded once when the request arrived (`encode_ms`: that encoding, from a token list)."""
        from engine.keys import TokenHasher  # the server's hash chain, timed on its own

        chunk = self.args.chunk_tokens
        layout = Layout(dtype="float16", num_layers=1, num_kv_heads=1, head_dim=64, block_size=chunk,
                        kind="bench-prompt", chunk_size=chunk)  # fmt: skip
        ids = np.random.default_rng(10_000 + self.args.client).integers(0, 50_000, tokens).tolist()
        start = time.perf_counter()
        wire = encode_tokens(ids)
        encode_s = time.perf_counter() - start
        n = tokens // chunk
        times, hashes = [], []
        with KVDepotClient(self.args.url, model="bench-prompt", layout=layout, timeout_s=30) as c:
            zeros = [torch.zeros(layout.chunk_bytes, dtype=torch.uint8)] * n
            stored = c.store(wire, zeros, request_id="prompt", cache_salt=self.salt).stored
            ok = stored == n
            for _ in range(samples):
                start = time.perf_counter()
                reply = c.lookup(wire, request_id="prompt", cache_salt=self.salt)
                times.append(time.perf_counter() - start)
                ok = ok and reply.hit_chunks == n
            c.end_request("prompt")
            c.clear(self.salt)
        hasher = TokenHasher(chunk)
        for _ in range(samples):
            start = time.perf_counter()
            hasher.chunk_hashes(wire)
            hashes.append(time.perf_counter() - start)
        hash_p50 = _percentile_ms(hashes, 0.5)
        return {
            "tokens": tokens, "chunks": n, "samples": samples,
            "lookup_p50_ms": _percentile_ms(times, 0.5), "lookup_p99_ms": _percentile_ms(times, 0.99),
            "hash_p50_ms": hash_p50, "hash_p99_ms": _percentile_ms(hashes, 0.99),
            "hash_ns_per_token": round(hash_p50 * 1e6 / tokens, 2),
            "encode_ms": round(encode_s * 1000, 3), "ok": ok,
        }  # fmt: skip

    def close(self) -> None:
        self.client.clear(self.salt)
        self.client.close()


def main(args: Any) -> int:
    """Run steps from stdin until `exit` (or end of input); one JSON answer a line."""
    worker = Worker(args)
    print(json.dumps({"ready": True, "chunk_bytes": worker.layout.chunk_bytes}), flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            print(json.dumps(worker.step(cmd)), flush=True)
    finally:
        worker.close()
    return 0
