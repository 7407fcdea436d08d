"""A KV-event consumer run as its own process by the tests, in the sidecar's venv or in vLLM's.

    python tests/kv_events_consumer.py ENDPOINT REPLAY_ENDPOINT EVENTS [--vllm] [--curve SERVER_PUB]

Subscribes to every topic, asks the replay socket for everything from sequence 0 (so nothing
published before the subscription took effect is missed), then reads live batches, repairing any
gap in the sequence numbers by replay, until batches 0..k hold EVENTS events; prints "subscribed" once
the SUB socket is connected, then one JSON object:
  {"batches": [{"seq", "topic", "elements", "events": [...]}], "replayed": [seqs from replay],
   "live": [seqs from the live stream], "identical": bool}
With --vllm the payloads are decoded by vLLM's own `vllm.distributed.kv_events.KVEventBatch` and
`identical` says whether vLLM's encoder gives back the same bytes. With --curve the sockets are
CURVE clients of the server key SERVER_PUB (client keys from KVDEPOT_TEST_CURVE_PUBLIC / _SECRET).
Exits 3 after 30 s without completion.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import msgspec
import zmq

END = -1


def main() -> int:
    endpoint, replay_endpoint, want = sys.argv[1], sys.argv[2], int(sys.argv[3])
    use_vllm = "--vllm" in sys.argv
    server_key = sys.argv[sys.argv.index("--curve") + 1].encode() if "--curve" in sys.argv else None
    if use_vllm:
        from vllm.distributed.kv_events import KVEventBatch  # type: ignore[import-not-found]

        decoder: Any = msgspec.msgpack.Decoder(type=KVEventBatch)
    raw_decoder = msgspec.msgpack.Decoder()
    ctx = zmq.Context()

    def secure(sock: zmq.Socket[bytes]) -> None:
        if server_key is not None:
            sock.curve_serverkey = server_key
            sock.curve_publickey = os.environ["KVDEPOT_TEST_CURVE_PUBLIC"].encode()
            sock.curve_secretkey = os.environ["KVDEPOT_TEST_CURVE_SECRET"].encode()

    sub = ctx.socket(zmq.SUB)
    secure(sub)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    replay = ctx.socket(zmq.DEALER)
    secure(replay)
    replay.connect(replay_endpoint)
    print("subscribed", flush=True)
    got: dict[int, dict[str, Any]] = {}
    replayed: list[int] = []
    live: list[int] = []
    identical = True

    def take(topic: bytes, seq: int, payload: bytes) -> None:
        nonlocal identical
        raw = raw_decoder.decode(payload)
        if use_vllm:
            batch = decoder.decode(payload)
            events = msgspec.to_builtins(batch.events)
            identical = identical and msgspec.msgpack.encode(batch) == payload
        else:
            events = raw[1]
        got[seq] = {"seq": seq, "topic": topic.decode(), "elements": len(raw), "events": events}

    def ask_replay(start: int) -> None:
        replay.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        while True:
            if not replay.poll(10_000):
                raise SystemExit(4)
            _, topic, seq_b, payload = replay.recv_multipart()
            seq = int.from_bytes(seq_b, "big", signed=True)
            if seq == END:
                return
            replayed.append(seq)
            take(topic, seq, payload)

    def complete() -> int | None:
        """k+1 when batches 0..k are held and hold `want` events, else None."""
        n = 0
        for s in range(len(got)):
            if s not in got:
                return None
            n += len(got[s]["events"])
            if n >= want:
                return s + 1
        return None

    ask_replay(0)
    deadline = time.monotonic() + 30
    while (count := complete()) is None:
        if time.monotonic() > deadline:
            print(json.dumps({"held": sorted(got)}), flush=True)
            return 3
        if not sub.poll(200):
            continue
        topic, seq_b, payload = sub.recv_multipart()
        seq = int.from_bytes(seq_b, "big")
        live.append(seq)
        missing = [s for s in range(seq) if s not in got]
        take(topic, seq, payload)
        if missing:
            ask_replay(missing[0])
    batches = [got[s] for s in range(count)]
    out = {"batches": batches, "replayed": replayed, "live": live, "identical": identical}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
