"""The sidecars' block hashes, recomputed from token ids: what lets the directory look a request up.

A sidecar announces chunk i of a prefix as blocks whose hashes are (api/kvevents/blocks.py)

    seed(ns, tenant) = blake3("kvdepot/kv-events/v1" 0 model 0 layout_fp rank:u32be group:u32be tenant)
    block(chunk, j)  = first 8 bytes, big-endian, of blake3(seed || chunk_hash || j:u32be)

with chunk_hash the rolling blake3 chain of engine/keys.py (`TokenHasher`, tokens as uint32 LE,
the chunk's extra key chained in when it has one). The directory indexes each chunk by its first
block (`j = 0`), so from a request's token ids, the namespace and the tenant it computes the same
integers and looks them up: no token ids need to be kept. `tenant` is the cache salt as the
sidecar's `kv_events.salt` says: `hashed` = keyed blake3 (16 bytes, hex) with a key derived from
the deployment key, `plain` = the salt, `omit` = "" (tenants merge: such an instance is never
scored for a salted request). The unit tests check these against the sidecar's own BlockNamer.

State: a bounded seed cache. Event loop only (or one thread).

Primitives: TenantNamer(deployment_key).tenant(salt, mode) -> str;
            first_blocks(token_bytes, chunk_size, seed, extras, limit) -> list[int];
            iter_first_blocks(...) the same, lazily;
            seed_of(model, layout_fp, kv_rank, group, tenant) -> bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import blake3

from engine.keys import SEED, TokenHasher
from fleet.spec import SaltMode
from kvdepot_connector.protocol import TOKEN_BYTES

SCHEME = b"kvdepot/kv-events/v1"
_BLOCK0 = struct.pack(">I", 0)


class TenantNamer:
    """How a salt appears in the events of a sidecar of salt mode `mode`."""

    def __init__(self, deployment_key: bytes | None) -> None:
        self.hashed_ok = deployment_key is not None
        self._salt_key = (
            blake3.blake3(b"kvdepot/kv-events/salt\0" + deployment_key).digest()
            if deployment_key is not None
            else b""
        )

    def tenant(self, salt: str, mode: SaltMode) -> str:
        if not salt or mode == "omit":
            return ""
        if mode == "plain":
            return salt
        if not self.hashed_ok:
            raise ValueError("no deployment key: hashed tenants cannot be named")
        return blake3.blake3(salt.encode(), key=self._salt_key).hexdigest(length=16)


def seed_of(model: str, layout_fp: bytes, kv_rank: int, group: int, tenant: str) -> bytes:
    h = blake3.blake3(SCHEME + b"\0" + model.encode() + b"\0" + layout_fp)
    h.update(struct.pack(">II", kv_rank, group) + tenant.encode())
    return h.digest()


def block_of(seed: bytes, chunk_hash: bytes, j: int = 0) -> int:
    return int.from_bytes(blake3.blake3(seed + chunk_hash + struct.pack(">I", j)).digest(length=8), "big")


def iter_first_blocks(token_bytes: bytes, chunk_size: int, seed: bytes, extra: bytes = b"") -> Iterator[int]:
    """`first_blocks`, lazily: the chain is hashed only as far as it is read (a score stops at the
    first chunk nobody holds). The same chain as engine/keys.py's TokenHasher (checked in tests).
    Per chunk two blake3 calls, the chain hash over prev || tokens || extra then the block hash:
    their cost is blake3's own (hashing the whole chain first, in one loop, is no faster)."""
    step = chunk_size * TOKEN_BYTES
    new = blake3.blake3
    from_bytes = int.from_bytes
    prev = SEED
    tail = _BLOCK0
    stop = len(token_bytes) - step + 1
    if extra:
        for start in range(0, stop, step):
            prev = new(prev + token_bytes[start : start + step] + extra).digest()
            yield from_bytes(new(seed + prev + tail).digest(8), "big")
    else:
        for start in range(0, stop, step):
            prev = new(prev + token_bytes[start : start + step]).digest()
            yield from_bytes(new(seed + prev + tail).digest(8), "big")


_hashers: dict[int, TokenHasher] = {}


def first_blocks(
    token_bytes: bytes, chunk_size: int, seed: bytes, extra: bytes = b"", limit: int | None = None
) -> list[int]:
    """The first block hash of each full chunk of `token_bytes` (uint32 LE), every chunk with the
    extra key `extra` (a LoRA adapter's; empty: none)."""
    hasher = _hashers.get(chunk_size)
    if hasher is None:
        if len(_hashers) > 64:
            _hashers.clear()
        hasher = _hashers[chunk_size] = TokenHasher(chunk_size)
    n = hasher.full_chunks(token_bytes)
    if limit is not None:
        n = min(n, limit)
    extras = [extra] * n if extra else ()
    chain = hasher.chunk_hashes(token_bytes, n, extras)
    new = blake3.blake3
    tail = _BLOCK0
    return [int.from_bytes(new(seed + h + tail).digest(length=8), "big") for h in chain]
