"""The verify-too baseline of `kvdepot bench l2 --adapter disk`: the disk adapter's own blob files,
read at the adapter's concurrency, each put through the same integrity check the sidecar runs on
every load, measured in the same run as the adapter's loads (bench/l2.py).

The plain disk baseline (bench/l2_baselines.py) reads files and checks nothing; but no load may
skip its check (the keyed-BLAKE3 MAC with the deployment's key for a tier that authenticates, else
the xxh3 payload checksum), so what the adapter should be held to is a program that reads the same
bytes and checks them too. Per blob file, on `threads` workers (one file per task):
  open, one preadv: the header into small memory, the payload straight into preallocated shared
  memory (touched beforehand, as the L1 arena is), close; then the check the adapter runs,
  codec.BlobCheck(...).beside(threads) (codec.verify_in_place with the deployment's keys, or none
  for a tier that does not authenticate, a large MAC on the same share of the cores): the header's
  checks and the MAC or checksum over the payload in shared memory.
`ok` says whether every blob passed its check and every chunk stored came back byte for byte
(compared outside the timing).

Primitives in call order: VerifyBaseline(blobs, chunks, layout_fp, keys, threads), load() (a warm
or a cold phase: the harness drops the files from the page cache before a cold one), close().
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from app.errors import IntegrityError
from bench.l2_baselines import Baseline, arena_like, free_arena, zero_all
from storage import codec
from storage.auth import BlobKeys
from storage.codec import blob_header


@dataclass(frozen=True, slots=True)
class BlobFile:
    """One blob the adapter wrote: its key (serialized), its file."""

    key: str
    path: str


class VerifyBaseline(Baseline):
    """Each of the adapter's blob files read (header apart, payload into shared memory) and
    checked as the adapter checks it, `threads` files at a time."""

    cold = True

    def __init__(
        self, blobs: Sequence[BlobFile], chunks: Sequence[bytes], layout_fp: bytes, keys: BlobKeys | None,
        threads: int,
    ) -> None:  # fmt: skip
        super().__init__(chunks, threads)
        if len(blobs) != len(chunks):
            raise ValueError(f"{len(blobs)} blob files for {len(chunks)} chunks")
        self.blobs = list(blobs)
        self._keys = keys
        # The adapter's own check, for as many checks at once: each MAC on the same share of cores.
        self._check = codec.BlobCheck(layout_fp, keys).beside(self.threads)
        self._mem, self._outs = arena_like(chunks)
        self._passed = [False] * len(self.blobs)

    @property
    def check(self) -> str:
        """What the check of each blob is, in words."""
        return "the keyed-BLAKE3 MAC, the deployment's key" if self._keys else "the xxh3 payload checksum"

    def _read_and_check(self, i: int) -> None:
        blob = self.blobs[i]
        out = self._outs[i]
        head = bytearray(blob_header.header_size(blob.key))
        fd = os.open(blob.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            views = [memoryview(head), out]
            offset = 0
            while views:
                n = os.preadv(fd, views, offset)
                if n == 0:
                    raise OSError(f"{blob.path} ended early")
                offset += n
                while views and n >= views[0].nbytes:
                    n -= views.pop(0).nbytes
                if views and n:
                    views[0] = views[0][n:]
        finally:
            os.close(fd)
        try:
            self._check(blob.key, head, out, True)
        except IntegrityError:
            return
        self._passed[i] = True

    def load(self) -> float:
        """Seconds to read and check every blob; then (untimed) whether they were all intact."""
        seconds = self._timed(self._read_and_check, len(self.blobs))
        stored = {bytes(c) for c in self.chunks}
        self.ok = self.ok and all(self._passed) and all(bytes(o) in stored for o in self._outs)
        self._passed = [False] * len(self.blobs)
        zero_all(self._outs)
        return seconds

    def close(self) -> None:
        super().close()
        free_arena(self._mem, self._outs)
