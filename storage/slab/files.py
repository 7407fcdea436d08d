"""SlabFiles: the slab adapter's open files and the executor every one of their operations runs in,
the index checkpoints among them (storage/slab/adapter.py owns one; the loop never touches a file).

State (event loop only): the files in config.paths order (a key's file is its number here), the
executor jobs running (a descriptor in use is never closed: its number could be reused), when the
next checkpoint is due (storage/slab/index.py Checkpointer).

Primitives in call order:
  open(size_bytes, slot_bytes)   open (or create, preallocate, format) each path, scan every slot's
                                 head, load the checkpoint; ConfigError naming the adapter and path
                                 (and nothing left open) for a foreign, damaged or wrongly sized file
  submit(fn, *args) / run(fn, *args)   an executor job, counted until done / awaited (`settled`)
  checkpoint_soon(snapshot)      after a change: a checkpoint of `snapshot()` once one is due
  wait_io()                      until no job runs
  close(snapshot)                wait (bounded) for jobs, checkpoint `snapshot()` (None: not started),
                                 close the files, shut the executor down when it is ours
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import structlog

from app.errors import ConfigError
from storage.inflight import CLOSE_WAIT_S, ExecutorJobs, gather_all, settled
from storage.slab import index
from storage.slab.file import ScanResult, SlabFile

log = structlog.get_logger("kvdepot.storage.slab")

T = TypeVar("T")


class SlabFiles:
    def __init__(
        self, name: str, paths: list[str], checkpoint_path: str, executor: ThreadPoolExecutor, *,
        owns_executor: bool, checkpointer: index.Checkpointer,
    ) -> None:  # fmt: skip
        self.name = name
        self.paths = paths
        self.checkpoint_path = checkpoint_path
        self.files: list[SlabFile] = []
        self.checkpointer = checkpointer
        self._executor = executor
        self._owns_executor = owns_executor
        self._jobs = ExecutorJobs(executor)

    def __getitem__(self, number: int) -> SlabFile:
        return self.files[number]

    def __len__(self) -> int:
        return len(self.files)

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        return self._jobs.submit(fn, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await settled(self.submit(fn, *args))

    async def open(
        self, size_bytes: int, slot_bytes: int
    ) -> tuple[list[ScanResult], index.Checkpoint | None]:
        """Each file opened and scanned, and the checkpoint (None: absent or unusable)."""
        try:
            for path in self.paths:
                self.files.append(await self.run(SlabFile.open, path, size_bytes, slot_bytes))
            scans = await gather_all(self.run(f.scan) for f in self.files)
            checkpoint = await self.run(index.load_checkpoint, self.checkpoint_path, slot_bytes)
        except ConfigError as exc:
            self._close_files()
            raise ConfigError(f"l2.adapters[{self.name}]: {exc}") from None
        except BaseException:
            self._close_files()
            raise
        return scans, checkpoint

    def checkpoint_soon(self, snapshot: Callable[[], index.Checkpoint]) -> None:
        """The index or its order changed: checkpoint it when the last one is old enough."""
        self.checkpointer.due(lambda: self.submit(index.save_checkpoint, self.checkpoint_path, snapshot()))

    async def wait_io(self) -> None:
        """Wait until no file operation (a checkpoint included) is running."""
        await self._jobs.wait()

    async def close(self, snapshot: Callable[[], index.Checkpoint] | None) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_WAIT_S):
                await self.wait_io()
        if snapshot is not None and self.files:
            try:
                await asyncio.wrap_future(
                    self._executor.submit(index.save_checkpoint, self.checkpoint_path, snapshot())
                )
                self.checkpointer.written += 1
            except Exception as exc:
                log.warning("slab_checkpoint_failed", adapter=self.name, error=repr(exc))
        if self._jobs:  # a descriptor in use may not be closed: its number could be reused
            log.warning("slab_files_left_open", adapter=self.name, jobs=len(self._jobs))
        else:
            self._close_files()
        if self._owns_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _close_files(self) -> None:
        for f in self.files:
            f.close()  # close(2) of a file opened O_DIRECT, no dirty pages: never blocks
