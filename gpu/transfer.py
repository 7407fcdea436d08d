"""TransferEngine: batches of copies on the device, awaited without blocking the event loop.

State: one stream of the device and the executor its waits run in. `run(pairs)` queues every
copy of the batch on the stream, records an event after them, and awaits `event.synchronize()`
in the executor (named, bounded, created at start-up). Batches are serialized on the stream; the
caller keeps the source and destination memory alive until `run` returns (the engine holds its
L1 locks or reservations meanwhile).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Executor

import torch

from gpu.device import Device


class TransferEngine:
    def __init__(self, device: Device, executor: Executor) -> None:
        self.device = device
        self._executor = executor
        self._stream = device.new_stream()
        self.batches = 0
        self.bytes = 0

    async def run(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each `src` into its `dst` (same number of bytes); returns when all are done."""
        for dst, src in pairs:
            if dst.numel() * dst.element_size() != src.numel() * src.element_size():
                raise ValueError("copy between regions of different sizes")
            self.device.copy(dst, src, self._stream)
        event = self.device.record(self._stream)
        await asyncio.get_running_loop().run_in_executor(self._executor, event.synchronize)
        self.batches += 1
        self.bytes += sum(d.numel() * d.element_size() for d, _ in pairs)
