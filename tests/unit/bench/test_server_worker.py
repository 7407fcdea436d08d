"""The bench client's own checks: its requests are its own, and a single wrong byte fails them."""

from __future__ import annotations

from bench.server_worker import make_requests


def test_a_wrong_byte_anywhere_fails_its_request() -> None:
    reqs = make_requests(3, requests=2, chunks=3, chunk_bytes=4096, chunk_tokens=16)
    assert [r.verified_bytes() for r in reqs] == [0, 0]  # the outputs start zeroed
    for r in reqs:
        r.memcpy()
    assert [r.verified_bytes() for r in reqs] == [3 * 4096, 3 * 4096]
    reqs[1].outs[2][4095] ^= 1
    assert [r.verified_bytes() for r in reqs] == [3 * 4096, 0]
    reqs[1].zero()
    assert reqs[1].verified_bytes() == 0


def test_clients_never_share_tokens_or_bytes() -> None:
    a = make_requests(0, requests=2, chunks=2, chunk_bytes=1024, chunk_tokens=16)
    b = make_requests(1, requests=2, chunks=2, chunk_bytes=1024, chunk_tokens=16)
    tokens = [r.tokens for r in a + b]
    assert len(set(tokens)) == 4 and all(len(t) == 2 * 16 * 4 for t in tokens)
    assert a[0].chunks[0].numpy().tobytes() != b[0].chunks[0].numpy().tobytes()
