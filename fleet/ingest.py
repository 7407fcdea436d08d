"""Ingest: a sidecar's KV-event batches (vLLM's wire format) and inventory lines, into the index.

Decoding uses structs of its own that declare only what the index needs (block hashes, block size,
medium, the LoRA name and, lazily, the extra keys): msgspec skips the token ids and the parent
without building them, which is most of a batch's bytes. `apply_batch` walks the events:

  BlockStored       each chunk's first block (every `chunk_size / block_size`-th hash) set in the
                    holder of (instance, medium); a LoRA chunk teaches the LoraBook the adapter's
                    extra key (the second entry of its `extra_keys`), so `/v1/score` can key a
                    request by adapter name;
  BlockRemoved      the same chunks cleared in that holder;
  AllBlocksCleared  every holder of the instance cleared; the caller resyncs from the inventory to
                    relearn the tiers that were not cleared (vLLM's event names no medium).

`InventoryLine` decodes one NDJSON line of `GET /inventory`.

State: the LoraBook (adapter name -> recent extra keys, bounded). Event loop only.
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from fleet.index import ChunkIndex
from fleet.registry import L1_MEDIUM, Instance, InstanceRegistry


class Stored(msgspec.Struct, tag_field="type", tag="BlockStored", gc=False):
    block_hashes: list[int]
    block_size: int = 0
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: msgspec.Raw = msgspec.Raw()


class Removed(msgspec.Struct, tag_field="type", tag="BlockRemoved", gc=False):
    block_hashes: list[int]
    medium: str | None = None


class Cleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", gc=False):
    pass


class Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Stored | Removed | Cleared]
    data_parallel_rank: int | None = None
    incarnation: str = ""


class InventoryLine(msgspec.Struct, gc=False):
    kind: str
    incarnation: str | None = None
    seq: int | None = None
    salt: str | None = None
    medium: str | None = None
    block_size: int | None = None
    block_hashes: list[int] | None = None
    chunks: int | None = None


batch_decoder = msgspec.msgpack.Decoder(Batch)
line_decoder = msgspec.json.Decoder(InventoryLine)
_extra_decoder = msgspec.msgpack.Decoder(list[list[str | int] | None] | None)


class LoraBook:
    """Adapter name -> the extra keys (32 bytes) its chunks were seen with, most recent first."""

    def __init__(self, per_name: int = 4, names: int = 4096) -> None:
        self.per_name = per_name
        self.names = names
        self._book: OrderedDict[str, OrderedDict[bytes, None]] = OrderedDict()

    def learn(self, name: str, extra: bytes) -> None:
        known = self._book.get(name)
        if known is None:
            if len(self._book) >= self.names:
                self._book.popitem(last=False)
            known = self._book[name] = OrderedDict()
        else:
            self._book.move_to_end(name)
        if extra in known:
            known.move_to_end(extra, last=False)
            return
        known[extra] = None
        known.move_to_end(extra, last=False)
        while len(known) > self.per_name:
            known.popitem()

    def extras(self, name: str) -> list[bytes]:
        known = self._book.get(name)
        return list(known) if known else []

    def learn_raw(self, name: str, raw: msgspec.Raw) -> None:
        try:
            entries = _extra_decoder.decode(raw)
        except msgspec.DecodeError:
            return
        for entry in (entries or [])[:1]:
            if entry and len(entry) >= 2 and entry[0] == name and isinstance(entry[1], str):
                text = entry[1]
                if len(text) == 64:
                    try:
                        self.learn(name, bytes.fromhex(text))
                    except ValueError:
                        return


def chunk_step(inst: Instance, block_size: int, n: int) -> int:
    """Blocks per chunk of the instance's events (all the hashes when unknown)."""
    spaces = inst.spec.namespaces
    if spaces:
        step = spaces[0].chunk_size // (block_size or spaces[0].block_size)
        if step > 0:
            return step
    return max(n, 1)


def apply_batch(registry: InstanceRegistry, inst: Instance, batch: Batch, lora: LoraBook) -> tuple[int, bool]:
    """Apply one batch. Answers (chunk events applied, whether the instance's holdings were
    cleared: a resync should relearn its other tiers)."""
    index: ChunkIndex = registry.index
    holders = inst.holders
    chunks = 0
    cleared = False
    for ev in batch.events:
        kind = type(ev)
        if kind is Stored or kind is Removed:
            medium = ev.medium or L1_MEDIUM  # type: ignore[union-attr]
            bit = holders.get(medium)
            if bit is None:
                bit = registry.holder_bit(inst, medium)
            hashes = ev.block_hashes  # type: ignore[union-attr]
            if kind is Stored:
                assert isinstance(ev, Stored)
                step = chunk_step(inst, ev.block_size, len(hashes))
                heads = hashes[::step]
                index.add_many(bit, heads)
                if ev.lora_name and medium == L1_MEDIUM:
                    lora.learn_raw(ev.lora_name, ev.extra_keys)
            else:
                heads = hashes[:: chunk_step(inst, 0, len(hashes))]
                for h in heads:
                    index.remove(bit, h)
            chunks += len(heads)
        else:
            index.clear(inst.mask())
            cleared = True
    return chunks, cleared
