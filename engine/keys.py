"""Keys: how a chunk of KV cache is named, identically in every process and after every restart.

- `TokenHasher` cuts a token sequence into chunks of `chunk_size` tokens (only full chunks count)
  and chains them: h(0) = H(SEED || tokens 0), h(i) = H(h(i-1) || tokens i). H is blake3 (32
  bytes); tokens are hashed as unsigned 32-bit little-endian integers
  (`kvdepot_connector.protocol.encode_tokens`, the wire format). No Python `hash()`, no random
  seed: the same tokens give the same hashes everywhere. A chunk whose KV depends on more than its
  tokens (a LoRA adapter, an image, prompt embeddings) has an extra key, a 32-byte digest the client
  computes: h(i) = H(h(i-1) || tokens i || extra i). Tokens are a fixed number of bytes, so a chunk
  with an extra key never hashes like one without; and through the chain every later chunk differs too.
- `KVLayout` describes one engine's KV memory (dtype, layers, kv heads, head dim, block size, layout
  kind, chunk size); its `fingerprint` is a stable 8-byte digest of the canonical form.
- `Namespace` = model id + layout fingerprint + kv rank + object group: everything about a key but
  the tenant and the chunk.
- `ObjectKey` = namespace + cache_salt + chunk hash. Keys that differ in any field never alias.

Serialized form (`ObjectKey.serialize`), stable and self-describing, used as the L2 key name::

    kvd1/m=<model, percent-encoded>/l=<layout fingerprint hex>/r=<kv rank>/g=<group>/s=<salt,
    percent-encoded>/h=<chunk hash hex>

`ObjectKey.parse` is its exact inverse; `salt_of` reads only its tenant (what the L2 adapters,
which see keys as opaque strings, are given to tell tenants apart).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import quote, unquote

import blake3

from kvdepot_connector import layout
from kvdepot_connector.protocol import EXTRA_KEY_BYTES, TOKEN_BYTES

HASH_BYTES = 32
SEED = blake3.blake3(b"kvdepot/token-chain/v1").digest()
KEY_VERSION = "kvd1"


class TokenHasher:
    """Rolling chunk hashes of token sequences. Stateless apart from `chunk_size`."""

    def __init__(self, chunk_size: int) -> None:
        if chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        self.chunk_size = chunk_size
        self._chunk_bytes = chunk_size * TOKEN_BYTES

    def full_chunks(self, token_bytes: bytes | memoryview) -> int:
        return len(token_bytes) // self._chunk_bytes

    def chunk_hashes(
        self, token_bytes: bytes | memoryview, limit: int | None = None, extras: Sequence[bytes] = ()
    ) -> list[bytes]:
        """Hashes of the full chunks of `token_bytes` (uint32 LE tokens), at most `limit` of them.
        `extras[i]`: chunk i's extra key (empty or EXTRA_KEY_BYTES; entries past the end: empty)."""
        n = self.full_chunks(token_bytes)
        if limit is not None:
            n = min(n, limit)
        view = memoryview(token_bytes)
        step = self._chunk_bytes
        prev = SEED
        out: list[bytes] = []
        if not any(extras[:n]):
            # The common case, in one tight loop: one hasher per chunk, fed prev || tokens.
            data = token_bytes if isinstance(token_bytes, bytes) else bytes(view[: n * step])
            new = blake3.blake3
            append = out.append
            for start in range(0, n * step, step):
                prev = new(prev + data[start : start + step]).digest()
                append(prev)
            return out
        for i in range(n):
            hasher = blake3.blake3(prev)
            hasher.update(view[i * step : (i + 1) * step])
            if i < len(extras) and extras[i]:
                extra = extras[i]
                if len(extra) != EXTRA_KEY_BYTES:
                    raise ValueError(
                        f"extra key of chunk {i} has {len(extra)} bytes, not 0 or {EXTRA_KEY_BYTES}"
                    )
                hasher.update(extra)
            prev = hasher.digest()
            out.append(prev)
        return out


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of one engine rank's KV cache, as far as a cached chunk depends on it."""

    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kind: str
    chunk_size: int
    fingerprint: bytes = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        layout.dtype_size(self.dtype)
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "chunk_size"):
            value = getattr(self, name)
            if not 0 < value <= 1 << 20:
                raise ValueError(f"{name} must be in 1..{1 << 20}, got {value}")
        if not self.kind or len(self.kind) > 64:
            raise ValueError("layout kind must be 1..64 characters")
        layout.blocks_per_chunk(self.chunk_size, self.block_size)
        canonical = (
            f"dtype={self.dtype};layers={self.num_layers};kv_heads={self.num_kv_heads};"
            f"head_dim={self.head_dim};block={self.block_size};kind={self.kind};chunk={self.chunk_size}"
        )
        object.__setattr__(self, "fingerprint", blake3.blake3(canonical.encode()).digest(length=8))

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk: K and V of every layer for `chunk_size` tokens."""
        return layout.chunk_bytes(
            self.dtype, num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, chunk_size=self.chunk_size,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that names a chunk apart from its tenant and its tokens."""

    model: str
    layout_fp: bytes
    kv_rank: int = 0
    group: int = 0
    _hash: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.model, self.layout_fp, self.kv_rank, self.group)))

    def __hash__(self) -> int:
        return self._hash


@dataclass(frozen=True, slots=True)
class ObjectKey:
    namespace: Namespace
    salt: str
    chunk_hash: bytes
    _hash: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.namespace._hash, self.salt, self.chunk_hash)))

    def __hash__(self) -> int:
        return self._hash

    def serialize(self) -> str:
        ns = self.namespace
        return (
            f"{KEY_VERSION}/m={quote(ns.model, safe='')}/l={ns.layout_fp.hex()}/r={ns.kv_rank}"
            f"/g={ns.group}/s={quote(self.salt, safe='')}/h={self.chunk_hash.hex()}"
        )

    @classmethod
    def parse(cls, text: str) -> ObjectKey:
        parts = text.split("/")
        if len(parts) != 7 or parts[0] != KEY_VERSION:
            raise ValueError(f"not a {KEY_VERSION} key: {text[:80]!r}")
        fields: dict[str, str] = {}
        for part in parts[1:]:
            name, sep, value = part.partition("=")
            if not sep or name in fields:
                raise ValueError(f"bad key field {part[:40]!r}")
            fields[name] = value
        try:
            ns = Namespace(
                model=unquote(fields["m"]),
                layout_fp=bytes.fromhex(fields["l"]),
                kv_rank=int(fields["r"]),
                group=int(fields["g"]),
            )
            chunk_hash = bytes.fromhex(fields["h"])
            return cls(ns, unquote(fields["s"]), chunk_hash)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"bad key {text[:80]!r}: {exc}") from None


def salt_of(serialized: str) -> str:
    """The cache_salt of a serialized key, read from its `s=` field alone. A string that is not a
    key of this version belongs to the default tenant ""."""
    rest, _, _ = serialized.rpartition("/")
    _, _, part = rest.rpartition("/")
    if not part.startswith("s=") or not serialized.startswith(KEY_VERSION + "/"):
        return ""
    return unquote(part[2:])
