"""The arena is a sealed memfd that clients receive over their lifeline: a client cannot resize it
(truncating it would SIGBUS the sidecar and every other client), and nothing is opened by name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import zmq

from kvdepot_connector import protocol as p
from kvdepot_connector.lifeline import LifelineClient
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import LAYOUT, chunk_data, client, request_tokens


def hello(url: str) -> p.HelloReply:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(url)
        sock.send(p.encode(p.Hello(id=1, version=p.PROTOCOL_VERSION)))
        assert sock.poll(10_000)
        reply = p.reply_decoder.decode(sock.recv())
    finally:
        sock.close()
        ctx.term()
    assert isinstance(reply, p.HelloReply)
    return reply


def test_a_client_cannot_truncate_the_arena_and_the_sidecar_lives(sidecar_factory: StartSidecar) -> None:
    sc = sidecar_factory(env={"KVDEPOT_L1__CHUNK_SIZE": "16"}, l1_size_gb=0.02)
    reply = hello(sc.url)
    assert reply.lifeline_path and len(reply.lifeline_token) == 32
    assert not (Path("/dev/shm") / reply.arena_name).exists()  # nothing to open by name
    line = LifelineClient(reply.lifeline_path, reply.lifeline_token)
    # The arena's segments (write domains) and the release fences, each read-only and sealed.
    fences = line.take("fences")
    fds = [line.take(f"arena:{i}") for i in range(len(line.received))]
    try:
        sizes = [os.fstat(fd).st_size for fd in fds]
        assert len(fds) > 1 and sum(sizes) == reply.arena_size
        fds.append(fences)
        sizes.append(os.fstat(fences).st_size)
        for fd, seg in zip(fds, sizes, strict=True):
            for size in (0, seg // 2, seg * 2):
                with pytest.raises((PermissionError, OSError)):
                    os.ftruncate(fd, size)  # read-only, and sealed: F_SEAL_SHRINK | F_SEAL_GROW
            assert os.fstat(fd).st_size == seg
    finally:
        for fd in fds:
            os.close(fd)
        line.close()
    c = client(sc.url)  # the sidecar and its other clients go on
    try:
        toks = request_tokens(3, 4)
        assert c.store(toks, [chunk_data(3, i) for i in range(4)], request_id="w").stored == 4
        assert c.lookup(toks, request_id="r").hit_chunks == 4
        outs = [torch.empty(LAYOUT.chunk_bytes // 2, dtype=torch.float16) for _ in range(4)]
        assert c.retrieve("r", outs)
        assert all(torch.equal(o, chunk_data(3, i)) for i, o in enumerate(outs))
        assert sc.get_json("/ready") == {"ready": True}
    finally:
        c.close()
