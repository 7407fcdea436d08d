"""Block hashes and the translation of the EventBus's chunk events into vLLM's block events.

A chunk (chunk_size tokens) is announced as its engine blocks (chunk_size / block_size of them,
block size from the layout the engine registered), so an indexer configured for the engine's block
size can use the events. The block hashes are kvdepot's own (not vLLM's internal ones), stable and
deterministic on every sidecar:

    seed(ns, tenant) = blake3("kvdepot/kv-events/v1" 0 model 0 layout_fp rank:u32be group:u32be tenant)
    block(chunk, j)  = first 8 bytes, big-endian, of blake3(seed || chunk_hash || j:u32be)

`chunk_hash` is already the rolling blake3 chain over the tokens (engine/keys.py), so block j of a
chunk names the whole prefix up to it; a chunk's first block has as parent the last block of the
chunk before it. Removals are computed from the key alone (no tokens needed). `tenant` is the
cache_salt as `kv_events.salt` says: `hashed` (keyed blake3 with a key derived from the deployment
key: routers sharing the deployment can match tenants without learning the salt), `plain`, or
`omit` (tenants merge in the hashes too). The tenant string also appears in `extra_keys`, like
vLLM's own cache_salt entry.

Each event names its tier as `medium` (`medium`: CPU for L1 and the adapter's name upper-cased for
an L2 tier unless `kv_events.medium_names` says otherwise).

State: a layout cache (fingerprint -> block and chunk size, learnt from registrations) and a seed
cache, both bounded. Event loop only.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Literal

import blake3

from api.kvevents.wire import MEDIUM_CPU, BlockRemoved, BlockStored
from engine.events import L1_TIER, Event
from engine.keys import KVLayout, Namespace, ObjectKey

SaltMode = Literal["hashed", "plain", "omit"]
SCHEME = b"kvdepot/kv-events/v1"
_SEEDS_MAX = 4096
_LAYOUTS_MAX = 1024

LayoutOf = Callable[[bytes], "KVLayout | None"]


def medium_of(tier: str) -> str:
    """The default medium of a tier: `CPU` for L1, the adapter's name upper-cased for an L2 tier
    (`kv_events.medium_names` changes it: KvEventsSettings.medium)."""
    return MEDIUM_CPU if tier == L1_TIER else tier.upper()


class BlockNamer:
    def __init__(
        self, *, salt_mode: SaltMode, deployment_key: bytes, layout_of: LayoutOf,
        medium: Callable[[str], str] = medium_of,
    ) -> None:  # fmt: skip
        self.salt_mode = salt_mode
        #: tier name (engine/events.py: L1_TIER or the adapter's) -> the `medium` its events carry
        self.medium = medium
        self._salt_key = blake3.blake3(b"kvdepot/kv-events/salt\0" + deployment_key).digest()
        self._layout_of = layout_of
        self._layouts: dict[bytes, tuple[int, int]] = {}
        self._seeds: dict[tuple[Namespace, str], bytes] = {}
        self.unknown_layout = 0
        """Events dropped because no engine registered the key's layout since the start."""

    def tenant(self, salt: str) -> str:
        if not salt or self.salt_mode == "omit":
            return ""
        if self.salt_mode == "plain":
            return salt
        return blake3.blake3(salt.encode(), key=self._salt_key).hexdigest(length=16)

    def sizes(self, layout_fp: bytes) -> tuple[int, int] | None:
        """(block_size, blocks per chunk) of a layout, or None when none was registered."""
        known = self._layouts.get(layout_fp)
        if known is not None:
            return known
        layout = self._layout_of(layout_fp)
        if layout is None:
            return None
        if len(self._layouts) >= _LAYOUTS_MAX:
            self._layouts.clear()
        known = self._layouts[layout_fp] = (layout.block_size, layout.chunk_size // layout.block_size)
        return known

    def _seed(self, ns: Namespace, salt: str) -> bytes:
        seed = self._seeds.get((ns, salt))
        if seed is None:
            if len(self._seeds) >= _SEEDS_MAX:
                self._seeds.clear()
            h = blake3.blake3(SCHEME + b"\0" + ns.model.encode() + b"\0" + ns.layout_fp)
            h.update(struct.pack(">II", ns.kv_rank, ns.group) + self.tenant(salt).encode())
            seed = self._seeds[(ns, salt)] = h.digest()
        return seed

    def block_hashes(self, key: ObjectKey, chunk_hash: bytes, blocks: int) -> list[int]:
        seed = self._seed(key.namespace, key.salt) + chunk_hash
        new = blake3.blake3
        pack = struct.Struct(">I").pack
        return [int.from_bytes(new(seed + pack(j)).digest(length=8), "big") for j in range(blocks)]

    def stored(self, ev: Event) -> BlockStored | None:
        """The blocks of a STORED event's chunk (token ids when the event carries them)."""
        assert ev.key is not None
        key, tokens, parent, extra, lora_name = ev.key, ev.tokens, ev.parent, ev.extra, ev.lora_name
        sizes = self.sizes(key.namespace.layout_fp)
        if sizes is None:
            self.unknown_layout += 1
            return None
        block_size, blocks = sizes
        hashes = self.block_hashes(key, key.chunk_hash, blocks)
        parent_hash = self.block_hashes(key, parent, blocks)[-1] if parent else None
        token_ids: list[int] = []
        if len(tokens) == 4 * block_size * blocks:
            token_ids = list(struct.unpack(f"<{len(tokens) // 4}I", tokens))
        entry: list[Any] = []
        if lora_name:
            entry.append(lora_name)
        if extra:
            entry.append(extra.hex())
        tenant = self.tenant(key.salt)
        if tenant:
            entry.append(tenant)
        extra_keys: list[tuple[Any, ...] | None] | None = [tuple(entry)] * blocks if entry else None
        return BlockStored(
            block_hashes=hashes, parent_block_hash=parent_hash, token_ids=token_ids,
            block_size=block_size, lora_id=None, medium=self.medium(ev.tier),
            lora_name=lora_name or None, extra_keys=extra_keys,
        )  # fmt: skip

    def removed(self, key: ObjectKey, tier: str) -> BlockRemoved | None:
        sizes = self.sizes(key.namespace.layout_fp)
        if sizes is None:
            self.unknown_layout += 1
            return None
        hashes = self.block_hashes(key, key.chunk_hash, sizes[1])
        return BlockRemoved(block_hashes=hashes, medium=self.medium(tier))
