"""TransferEngine: batches of copies on the device, awaited without blocking the event loop.

State: one stream of the device and the executor its waits run in (named, bounded, created at
start-up). Two ways to copy:
- `run(pairs)`: queue every copy of a small batch on the stream from the loop, record an event
  after them, await `event.synchronize()` in the executor.
- `run_lazy(copies)`: `copies()` yields the pairs one at a time and is iterated in the executor,
  on a stream of its own, synchronized every `batch` pairs: a call costs the loop nothing but the
  await, and memory for one batch of views, however many copies it makes.
The caller keeps the source and destination memory alive until either returns (the engine holds
its L1 locks or reservations meanwhile).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor

import torch

from gpu.device import Device

CopyPair = tuple[torch.Tensor, torch.Tensor]  # (dst, src), the same number of bytes
BATCH = 1024


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TransferEngine:
    def __init__(self, device: Device, executor: Executor, *, batch: int = BATCH) -> None:
        self.device = device
        self._executor = executor
        self._stream = device.new_stream()
        self._batch = batch
        self.batches = 0
        self.bytes = 0

    async def run(self, pairs: Sequence[CopyPair]) -> None:
        """Copy each `src` into its `dst` (same number of bytes); returns when all are done."""
        for dst, src in pairs:
            if _nbytes(dst) != _nbytes(src):
                raise ValueError("copy between regions of different sizes")
            self.device.copy(dst, src, self._stream)
        event = self.device.record(self._stream)
        await asyncio.get_running_loop().run_in_executor(self._executor, event.synchronize)
        self.batches += 1
        self.bytes += sum(_nbytes(d) for d, _ in pairs)

    async def run_lazy(self, copies: Callable[[], Iterable[CopyPair]]) -> int:
        """Make every copy `copies()` yields, in the executor; returns the bytes copied."""
        loop = asyncio.get_running_loop()
        done = await loop.run_in_executor(self._executor, self._execute, copies)
        self.batches += 1
        self.bytes += done
        return done

    def _execute(self, copies: Callable[[], Iterable[CopyPair]]) -> int:
        stream = self.device.new_stream()  # its own: concurrent calls never sync each other's copies
        queued = done = 0
        try:
            for dst, src in copies():
                n = _nbytes(dst)
                if n != _nbytes(src):
                    raise ValueError("copy between regions of different sizes")
                self.device.copy(dst, src, stream)
                done += n
                queued += 1
                if queued == self._batch:
                    self.device.record(stream).synchronize()
                    queued = 0
        finally:
            self.device.record(stream).synchronize()  # nothing of this call is left in flight
        return done
