"""Extra keys: what changes a chunk's KV besides its token ids, as vLLM keys its own prefix cache.

vLLM's prefix cache hashes each block's tokens with "extra keys" (`generate_block_hash_extra_keys`
in vllm/v1/core/kv_cache_utils.py): the LoRA adapter, the multimodal items the block overlaps
(identifier and offset) and a hash of the block's prompt embeddings. Two requests with the same
token ids but another adapter, another image behind the same placeholder tokens, or other prompt
embeddings compute other KV; a cache that keys tokens alone serves one the other's KV.

Here each chunk gets one extra key (`protocol.Lookup.extra_keys`): a blake3 digest of

  - the adapter: its name and a fingerprint of its files (`AdapterFingerprints`), so a name
    re-pointed at, or reloaded with, other weights does not alias (vLLM keys name and path only);
  - every multimodal item overlapping the chunk: identifier, offset and length in the prompt;
  - the chunk's prompt embeddings (dtype, shape, bytes) and, for prompts mixing token ids and
    embeddings, which positions are which;

and the sidecar chains it into the chunk's hash, so a chunk's key also covers every item in the
chunks before it. Chunks past the prompt (generated tokens) carry the adapter only. A request
without any of these has no extra keys and the same keys as before.

What cannot be keyed safely is not cached (`Uncacheable`): an adapter whose files cannot be read
(e.g. a hub id vLLM resolves elsewhere), a multimodal item without an identifier.

Pure (no vLLM import): it reads the request's attributes by name, so it runs on vLLM's objects
and on tests' stand-ins alike. State: the fingerprint cache, on the scheduler thread only.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import msgspec

from kvdepot_connector.protocol import Uncacheable

DOMAIN = b"kvdepot/extra-keys/v1\x00"
#: adapters larger than this are not hashed (a miss): hashing must stay a one-off of moments
MAX_ADAPTER_BYTES = 8 << 30

_encode = msgspec.msgpack.Encoder().encode


@dataclass(frozen=True, slots=True)
class MMItem:
    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class RequestKeys:
    """The extra-key inputs of one request, found once; `extras(n)` gives the per-chunk keys."""

    chunk_size: int
    prompt_tokens: int
    lora: tuple[str, bytes] | None = None  # adapter name, fingerprint of its files
    mm: tuple[MMItem, ...] = ()
    embeds: tuple[bytes, ...] = ()  # per prompt chunk (the last may be partial)

    @property
    def plain(self) -> bool:
        return self.lora is None and not self.mm and not self.embeds

    def extras(self, num_chunks: int) -> tuple[bytes, ...]:
        """Extra keys of chunks 0..num_chunks-1 (empty: no chunk has one)."""
        if self.plain:
            return ()
        out = []
        size = self.chunk_size
        for i in range(num_chunks):
            start, end = i * size, (i + 1) * size
            parts: list[Any] = []
            if self.lora is not None:
                parts.append(("lora", self.lora[0], self.lora[1]))
            for item in self.mm:
                if item.offset < end and item.offset + item.length > start:
                    parts.append(("mm", item.identifier, item.offset, item.length))
            if i < len(self.embeds):
                parts.append(("embeds", self.embeds[i]))
            out.append(blake3.blake3(DOMAIN + _encode(parts)).digest() if parts else b"")
        return tuple(out)


class AdapterFingerprints:
    """blake3 over a LoRA adapter's files (names, sizes, contents), hashed again only when a file's
    size or mtime changes. None when the path is no readable local directory."""

    def __init__(self, max_bytes: int = MAX_ADAPTER_BYTES) -> None:
        self.max_bytes = max_bytes
        self._known: dict[str, tuple[tuple[tuple[str, int, int], ...], bytes]] = {}

    def fingerprint(self, path: str) -> bytes | None:
        try:
            stamp = _stamp(Path(path))
        except OSError:
            return None
        if not stamp or sum(size for _, size, _ in stamp) > self.max_bytes:
            return None
        known = self._known.get(path)
        if known is not None and known[0] == stamp:
            return known[1]
        hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        try:
            for name, size, _ in stamp:
                hasher.update(_encode((name, size)))
                with open(os.path.join(path, name), "rb") as f:
                    while block := f.read(1 << 22):
                        hasher.update(block)
        except OSError:
            return None
        digest = hasher.digest()
        self._known[path] = (stamp, digest)
        return digest


def _stamp(directory: Path) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime_ns) of every regular file directly in `directory`, sorted."""
    if not directory.is_dir():
        return ()
    out = []
    for entry in os.scandir(directory):
        if entry.is_file(follow_symlinks=True):
            st = entry.stat(follow_symlinks=True)
            out.append((entry.name, st.st_size, st.st_mtime_ns))
    return tuple(sorted(out))


def request_keys(
    request: Any, chunk_size: int, adapters: AdapterFingerprints
) -> RequestKeys | Uncacheable:
    """The extra-key inputs of a vLLM `Request` (v1): lora_request, mm_features, prompt_embeds,
    prompt_is_token_ids. Uncacheable when one of them cannot be keyed."""
    prompt_tokens = int(request.num_prompt_tokens)
    lora = None
    lora_request = getattr(request, "lora_request", None)
    if lora_request is not None:
        fp = adapters.fingerprint(str(getattr(lora_request, "lora_path", "") or ""))
        if fp is None:
            return Uncacheable.LORA_UNFINGERPRINTED
        lora = (str(lora_request.lora_name), fp)
    items = []
    for feature in getattr(request, "mm_features", None) or ():
        identifier = getattr(feature, "identifier", None)
        position = getattr(feature, "mm_position", None)
        if not identifier or position is None:
            return Uncacheable.MM_UNIDENTIFIED
        items.append(MMItem(str(identifier), int(position.offset), int(position.length)))
    embeds: tuple[bytes, ...] = ()
    tensor = getattr(request, "prompt_embeds", None)
    if tensor is not None:
        try:
            embeds = _embed_hashes(tensor, getattr(request, "prompt_is_token_ids", None), chunk_size)
        except (TypeError, ValueError, RuntimeError):
            return Uncacheable.EMBEDS_UNHASHABLE
    return RequestKeys(chunk_size, prompt_tokens, lora, tuple(items), embeds)


def _embed_hashes(tensor: Any, mask: Sequence[bool] | None, chunk_size: int) -> tuple[bytes, ...]:
    """Per chunk of positions: blake3 of dtype, shape and bytes of the embeddings (and of the
    token/embedding mask of a mixed prompt)."""
    import torch

    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 1:
        raise TypeError("prompt_embeds is not a tensor")
    rows = tensor.shape[0]
    out = []
    for start in range(0, rows, chunk_size):
        part = tensor[start : start + chunk_size].detach().cpu().contiguous()
        hasher = blake3.blake3(_encode(("embeds", str(part.dtype), list(part.shape))))
        hasher.update(part.view(torch.uint8).numpy().data)
        if mask is not None:
            hasher.update(_encode([bool(m) for m in list(mask)[start : start + chunk_size]]))
        out.append(hasher.digest())
    return tuple(out)
