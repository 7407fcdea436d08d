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
                    relearn the tiers that were not cleared (vLLM's event names no medium). A
                    batch's last one is applied first, the events before it skipped: one pass over
                    the index per batch, however many it names.

With the non-prefix matcher on, `BatchTokens` decodes the token ids too, and each batch's stores
(chunk tokens, first block hash, scope: model, tenant from `extra_keys`, adapter) go to the
Matchers in one call (fleet/match.py).

`InventoryReader` reads one `GET /inventory` listing (NDJSON lines, a page decoded in one call)
into a resync of the instance's holders.

Bounds: an instance indexes at most `registry.max_chunks` chunks over all its media (live stores
past what it holds, a listing past the cap: dropped, counted in `registry.capped`). What an
instance announces lands in its own holders only: it cannot clear or replace another's. A batch
costs work linear in its events (at most `directory.max_event_bytes`), plus one index pass.

State: the LoraBook (adapter name -> recent extra keys, bounded). Event loop only.

Primitives: batch_decoder.decode(payload) -> apply_batch(registry, inst, batch, lora, matchers);
InventoryReader(registry, inst) -> feed_page(lines)/feed(line) ... -> finish().
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import msgspec

from fleet.index import ChunkIndex
from fleet.match import Matchers
from fleet.registry import Instance, InstanceRegistry
from kvdepot_connector.protocol import encode_tokens


class Stored(msgspec.Struct, tag_field="type", tag="BlockStored", gc=False):
    block_hashes: list[int]
    block_size: int = 0
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: msgspec.Raw = msgspec.Raw()


class StoredTokens(Stored, tag="BlockStored"):
    """A store with its token ids (decoded only when the non-prefix matcher is on)."""

    token_ids: list[int] = []


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


class ListedChunk(msgspec.Struct, tag_field="kind", tag="chunk", gc=False):
    block_hashes: list[int]
    medium: str | None = None
    block_size: int = 0


class ListingHeader(msgspec.Struct, tag_field="kind", tag="header", gc=False):
    incarnation: str
    seq: int = -1


class ListingEnd(msgspec.Struct, tag_field="kind", tag="end", gc=False):
    chunks: int = 0


InventoryLine = ListedChunk | ListingHeader | ListingEnd
_UNSET = "\0unset"
class BatchTokens(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[StoredTokens | Removed | Cleared]
    data_parallel_rank: int | None = None
    incarnation: str = ""


batch_decoder = msgspec.msgpack.Decoder(Batch)
batch_tokens_decoder = msgspec.msgpack.Decoder(BatchTokens)
line_decoder = msgspec.json.Decoder(InventoryLine)
page_decoder = msgspec.json.Decoder(list[InventoryLine])
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
        """From a store's `extra_keys` (the adapter's name first, then its extra key as 64 hex
        digits). A store naming the adapter without an extra key was keyed like the base model
        (the client gave none): the empty key is learnt for the name then."""
        try:
            entries = _extra_decoder.decode(raw)
        except msgspec.DecodeError:
            return
        for entry in (entries or [])[:1]:
            if not entry or entry[0] != name:
                return
            text = entry[1] if len(entry) >= 2 else None
            if isinstance(text, str) and len(text) == 64 and _is_hex(text):
                self.learn(name, bytes.fromhex(text))
            else:
                self.learn(name, b"")


class InventoryReader:
    """One `GET /inventory` listing of one instance, line by line, into a resync of its holders:
    `feed(line)` each NDJSON line, then `finish()` -> (incarnation, seq) once the end line came
    (None when the listing was cut short: the resync is abandoned, nothing is removed)."""

    def __init__(self, registry: InstanceRegistry, inst: Instance) -> None:
        self.registry = registry
        self.inst = inst
        self.resync = registry.index.begin_resync(inst.mask())
        self.incarnation: str | None = None
        self.seq = -1
        self.ended = False
        self.gone = 0
        self._pending: dict[str, list[int]] = {}
        """medium -> first block hashes listed, not yet added (added in slices: fewer calls)."""
        self._steps: dict[tuple[int, int], int] = {}

    def feed(self, raw: bytes | str) -> None:
        """One NDJSON line (DecodeError when it is none of the listing's lines)."""
        self._take([line_decoder.decode(raw)])

    def feed_page(self, lines: list[bytes]) -> None:
        """Several NDJSON lines at once (without their newlines), decoded in one call."""
        if lines:
            self._take(page_decoder.decode(b"[" + b",".join(lines) + b"]"))

    def _take(self, lines: list[InventoryLine]) -> None:
        medium: str | None = _UNSET  # a first line without a medium is L1's too
        pending: list[int] = []
        for line in lines:
            if type(line) is ListedChunk:
                hashes = line.block_hashes
                if not hashes:
                    continue
                if line.medium != medium:
                    medium = line.medium
                    pending = self._pending.setdefault(medium or self.inst.spec.l1_medium, [])
                shape = (line.block_size, len(hashes))
                step = self._steps.get(shape)
                if step is None:
                    step = self._steps[shape] = chunk_step(self.inst, shape[0], shape[1])
                if step >= len(hashes):
                    pending.append(hashes[0])
                else:
                    pending.extend(hashes[::step])
            elif type(line) is ListingHeader:
                self.incarnation = line.incarnation
                self.seq = line.seq
            elif type(line) is ListingEnd:
                self.ended = True
        if sum(len(p) for p in self._pending.values()) >= 8192:
            self._flush()

    def _flush(self) -> None:
        inst = self.inst
        for medium, heads in self._pending.items():
            if heads:
                room = self.registry.max_chunks - self.resync.listed  # the listing replaces all
                if len(heads) > room:
                    self.registry.capped += len(heads) - max(room, 0)
                    del heads[max(room, 0) :]
                    if not heads:
                        continue
                bit = inst.holders.get(medium)
                if bit is None:
                    bit = self.registry.holder_bit(inst, medium)
                self.resync.add(bit, heads)
        self._pending = {}

    def finish(self) -> tuple[str, int] | None:
        self._flush()
        if not self.ended or self.incarnation is None:
            return None
        self.gone = self.resync.finish()
        return self.incarnation, self.seq


def chunk_step(inst: Instance, block_size: int, n: int) -> int:
    """Blocks per chunk of the instance's events (all the hashes when unknown)."""
    spaces = inst.spec.namespaces
    if spaces:
        step = spaces[0].chunk_size // (block_size or spaces[0].block_size)
        if step > 0:
            return step
    return max(n, 1)


def tenant_of(raw: msgspec.Raw, lora_name: str | None) -> str | None:
    """The tenant a store's `extra_keys` name (its entries: the LoRA name, the extra key as 64 hex
    digits, the tenant, each when present); "" for none; None when unreadable."""
    try:
        entries = _extra_decoder.decode(raw)
    except msgspec.DecodeError:
        return None
    if not entries or not entries[0]:
        return ""
    items = [str(x) for x in entries[0]]
    if lora_name and items and items[0] == lora_name:
        items = items[1:]
    if len(items) >= 2:
        return items[1]
    if len(items) == 1 and not (len(items[0]) == 64 and _is_hex(items[0])):
        return items[0]
    return ""


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True


def apply_batch(
    registry: InstanceRegistry, inst: Instance, batch: Batch | BatchTokens, lora: LoraBook,
    matchers: Matchers | None = None,
) -> tuple[int, bool]:  # fmt: skip
    """Apply one batch. Answers (chunk events applied, whether the instance's holdings were
    cleared: a resync should relearn its other tiers). `matchers`: stores with token ids teach the
    non-prefix matcher too."""
    index: ChunkIndex = registry.index
    holders = inst.holders
    chunks = 0
    cleared = False
    room: int | None = None
    """Chunks the instance may still add (asked on its first store)."""
    learning: list[tuple[StoredTokens, int]] = []
    l1 = inst.spec.l1_medium
    events = batch.events
    last_clear = _last_clear(events)
    if last_clear >= 0:  # what came before it is cleared with it: one pass over the index per batch
        index.clear(inst.mask())
        cleared = True
        events = events[last_clear + 1 :]
    for ev in events:
        kind = type(ev)
        if kind is Stored or kind is Removed or kind is StoredTokens:
            medium = ev.medium or l1  # type: ignore[union-attr]
            bit = holders.get(medium)
            if bit is None:
                bit = registry.holder_bit(inst, medium)
            hashes = ev.block_hashes  # type: ignore[union-attr]
            if kind is not Removed:
                assert isinstance(ev, Stored)
                step = chunk_step(inst, ev.block_size, len(hashes))
                heads = hashes[::step]
                if room is None:
                    room = registry.room(inst)
                if len(heads) > room:  # past the instance's cap: dropped, counted
                    registry.capped += len(heads) - max(room, 0)
                    heads = heads[: max(room, 0)]
                room -= index.add_many(bit, heads)
                if ev.lora_name and medium == l1:
                    lora.learn_raw(ev.lora_name, ev.extra_keys)
                if matchers is not None and isinstance(ev, StoredTokens) and ev.token_ids and len(heads) == 1:
                    learning.append((ev, heads[0]))
            else:
                heads = hashes[:: chunk_step(inst, 0, len(hashes))]
                for h in heads:
                    index.remove(bit, h)
                room = None
            chunks += len(heads)
        else:
            index.clear(inst.mask())
            cleared = True
            room = None
    if learning and matchers is not None:
        _learn(matchers, inst, learning)
    return chunks, cleared


def _last_clear(events: Sequence[object]) -> int:
    """Where the batch's last AllBlocksCleared is (-1: none)."""
    for at in range(len(events) - 1, -1, -1):
        if type(events[at]) is Cleared:
            return at
    return -1


def _learn(matchers: Matchers, inst: Instance, stores: list[tuple[StoredTokens, int]]) -> None:
    """Teach the matcher a batch's stores: (scope, tokens, first block hash) each."""
    spaces = inst.spec.namespaces
    if not spaces:
        return
    size = spaces[0].chunk_size
    matcher = matchers.get(size)
    if matcher is None:
        return
    tenants: dict[tuple[bytes, str | None], str | None] = {}  # a request's chunks share extra keys
    items = []
    for ev, head in stores:
        if len(ev.token_ids) != size:
            continue
        key = (bytes(ev.extra_keys), ev.lora_name)
        if key not in tenants:
            tenants[key] = tenant_of(ev.extra_keys, ev.lora_name)
        tenant = tenants[key]
        if tenant is None:
            continue
        try:
            tokens = encode_tokens(ev.token_ids)
        except (OverflowError, TypeError):
            continue
        items.append(((spaces[0].model, tenant, ev.lora_name or ""), tokens, head))
    matcher.learn_many(items)
