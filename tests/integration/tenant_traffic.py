"""Tenant traffic for the integration tests with a real sidecar: HTTP calls with the admin token,
token sequences whose prefixes share chunks, bytes that differ per tenant, store and read through
the data-plane client."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import torch

from bench.sidecar import SidecarProcess
from kvdepot_connector.client import KVDepotClient
from tests.integration.dp_client import CHUNK_TOKENS, LAYOUT, chunk_data, request_tokens

CHUNK_BYTES = LAYOUT.chunk_bytes  # 64 KiB
TOKEN = "tenant-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def http(
    sc: SidecarProcess, method: str, path: str, body: Any = None, token: bool | str = True
) -> tuple[int, Any]:
    """(status, JSON answer or None) of one call to `sc`'s control plane, with this module's admin
    token (`token` true), another one (a string) or none (false)."""
    data = None if body is None else json.dumps(body).encode()
    bearer = TOKEN if token is True else token
    headers = {"content-type": "application/json"} | ({"Authorization": f"Bearer {bearer}"} if bearer else {})
    req = urllib.request.Request(sc.http + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def sequence(which: int, chunks: int) -> list[int]:
    """The first `chunks` chunks of sequence `which`: every prefix of it shares its chunk hashes."""
    return request_tokens(which, 8)[: chunks * CHUNK_TOKENS]


def content(tag: int, which: int, chunk: int) -> torch.Tensor:
    """What tenant `tag` stores for chunk `chunk` of sequence `which`: different per tenant."""
    return chunk_data(1000 * (tag + 1) + which, chunk)


def store(c: KVDepotClient, salt: str, tag: int, which: int, chunks: int, rid: str) -> Any:
    toks = sequence(which, chunks)
    return c.store(toks, [content(tag, which, i) for i in range(chunks)], request_id=rid, cache_salt=salt)


def read(
    c: KVDepotClient, salt: str, which: int, chunks: int, rid: str, *, wait: bool = False
) -> list[torch.Tensor]:
    """Lookup (`wait`: until the L2 prefetch is done), then retrieve every chunk it found (the
    client releases the locks)."""
    hit = c.lookup(sequence(which, chunks), request_id=rid, cache_salt=salt, wait=wait).hit_chunks
    outs = [torch.empty(CHUNK_BYTES // 2, dtype=torch.float16) for _ in range(hit)]
    if hit:
        assert c.retrieve(rid, outs)
    else:
        c.end_request(rid)
    return outs
