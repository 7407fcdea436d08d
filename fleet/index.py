"""ChunkIndex: which holder (an instance's tier) holds which chunk, as one dict of bitmasks.

A chunk is named by its first block hash (a 64-bit integer: fleet/hashing.py); a holder is one
tier of one instance (its L1 `CPU`, or one of its L2 tiers by medium) and owns one bit. The index
is `dict[int, int]`: block hash -> bitmask of the holders that hold it, about 100 bytes per chunk
whatever the number of holders up to 60 (a Python int of one machine word). Bits are handed out
once per holder and recycled when an instance is forgotten (`drop_holders`).

Shared tiers: each instance's view of a shared tier (its `REDIS` medium, say) is a holder of its
own; an instance counts the chunks of every holder on the same shared tier (fleet/score.py), so a
resync of one instance never wipes what another one wrote there.

State: the dict, per-holder chunk counts, the bit allocator. Event loop only.

Primitives in call order:
  holder(key) -> bit                 the bit of a holder (allocated on first use)
  add(bit, h) / remove(bit, h)       one chunk stored / removed in one holder
  clear(mask)                        every chunk of these holders forgotten (AllBlocksCleared)
  begin_resync(mask) -> Resync ... resync.add(bit, h) ... resync.finish()
                                     replace what these holders hold with a listing
  get(h) -> mask                     (scoring)
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable


class ChunkIndex:
    def __init__(self) -> None:
        self.masks: dict[int, int] = {}
        self.counts: dict[int, int] = {}
        """bit index -> chunks its holder holds."""
        self._bits: dict[Hashable, int] = {}
        self._free: list[int] = []
        self._next = 0

    def __len__(self) -> int:
        return len(self.masks)

    def holder(self, key: Hashable) -> int:
        bit = self._bits.get(key)
        if bit is None:
            if self._free:
                bit = self._free.pop()
            else:
                bit = self._next
                self._next += 1
            self._bits[key] = bit
            self.counts[bit] = 0
        return bit

    def bit_of(self, key: Hashable) -> int | None:
        return self._bits.get(key)

    def add(self, bit: int, h: int) -> None:
        flag = 1 << bit
        masks = self.masks
        m = masks.get(h, 0)
        if not m & flag:
            masks[h] = m | flag
            self.counts[bit] += 1

    def add_many(self, bit: int, hashes: Iterable[int]) -> int:
        """Answers how many were new to the holder."""
        flag = 1 << bit
        masks = self.masks
        get = masks.get
        added = 0
        for h in hashes:
            m = get(h, 0)
            if not m & flag:
                masks[h] = m | flag
                added += 1
        self.counts[bit] += added
        return added

    def remove(self, bit: int, h: int) -> None:
        flag = 1 << bit
        masks = self.masks
        m = masks.get(h, 0)
        if m & flag:
            m &= ~flag
            if m:
                masks[h] = m
            else:
                del masks[h]
            self.counts[bit] -= 1

    def get(self, h: int) -> int:
        return self.masks.get(h, 0)

    def clear(self, mask: int) -> None:
        """Forget every chunk of the holders in `mask` (one pass over the index)."""
        if not mask:
            return
        keep = ~mask
        masks = self.masks
        for h, m in list(masks.items()):
            if m & mask:
                left = m & keep
                if left:
                    masks[h] = left
                else:
                    del masks[h]
        for bit in _bits_of(mask):
            if bit in self.counts:
                self.counts[bit] = 0

    def drop_holders(self, keys: Iterable[Hashable]) -> None:
        """Forget these holders and their chunks; their bits become free."""
        mask = 0
        for key in keys:
            bit = self._bits.pop(key, None)
            if bit is not None:
                mask |= 1 << bit
                self._free.append(bit)
        self.clear(mask)
        for bit in _bits_of(mask):
            self.counts.pop(bit, None)

    def begin_resync(self, mask: int) -> Resync:
        return Resync(self, mask)


class Resync:
    """A listing replacing what the holders of `mask` hold. Chunks listed are added at once (the
    index never dips below the listing while it streams); `finish` removes the holders' chunks that
    the listing did not name."""

    def __init__(self, index: ChunkIndex, mask: int) -> None:
        self.index = index
        self.mask = mask
        self.seen: dict[int, set[int]] = {}
        self.listed = 0

    def add(self, bit: int, hashes: list[int]) -> None:
        seen = self.seen.get(bit)
        if seen is None:
            seen = self.seen[bit] = set()
        seen.update(hashes)
        self.index.add_many(bit, hashes)
        self.listed += len(hashes)

    def finish(self) -> int:
        """Remove what was held but not listed. Answers how many (holder, chunk) pairs went."""
        index, mask = self.index, self.mask
        masks, counts = index.masks, index.counts
        empty: set[int] = set()
        bits = [(bit, 1 << bit, self.seen.get(bit, empty)) for bit in _bits_of(mask)]
        # a holder holding exactly what was listed has nothing to lose: no pass over the index
        bits = [b for b in bits if counts.get(b[0], 0) > len(b[2])]
        if not bits:
            return 0
        mask = 0
        for _bit, flag, _seen in bits:
            mask |= flag
        gone = 0
        for h, m in list(masks.items()):
            if not m & mask:
                continue
            new = m
            for bit, flag, seen in bits:
                if new & flag and h not in seen:
                    new &= ~flag
                    counts[bit] -= 1
                    gone += 1
            if new != m:
                if new:
                    masks[h] = new
                else:
                    del masks[h]
        return gone


def _bits_of(mask: int) -> list[int]:
    out = []
    bit = 0
    while mask:
        if mask & 1:
            out.append(bit)
        mask >>= 1
        bit += 1
    return out
