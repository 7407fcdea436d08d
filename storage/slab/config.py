"""The slab adapter's config: its files or block devices, their slot size, its I/O and checkpoint.

Read by storage/slab/ (the adapter, its files, slots and index); listed in storage/registry.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from storage.config import AdapterConfigBase, AdapterName

SLAB_ALIGN = 4096
"""Slab files are read and written with O_DIRECT in units of this many bytes."""


class SlabAdapterConfig(AdapterConfigBase):
    """Slab-file L2: preallocated files (or raw block devices) cut into fixed slots, one chunk per
    slot, O_DIRECT I/O, a slot index checkpointed beside the data dir and checked against the slots'
    own headers at start."""

    type: Literal["slab"] = "slab"
    name: AdapterName = "slab"
    paths: list[Path] = Field(
        default_factory=list,
        max_length=64,
        description="Slab files or block devices, keys sharded over them; empty = <data_dir>/l2-slab.",
    )
    size_bytes: int = Field(
        8 << 30,
        ge=3 * SLAB_ALIGN,
        le=1 << 50,
        description="Size of each slab file (a block device: its own size).",
    )
    slot_bytes: int = Field(
        16 << 20,
        ge=2 * SLAB_ALIGN,
        le=1 << 30,
        description="Bytes per slot, a multiple of 4096: one chunk's blob plus 4 KiB of headers.",
    )
    capacity_gb: float | None = Field(
        None, gt=0, le=1 << 20, description="Bytes of slots in use at most (LRU eviction); None = all slots."
    )
    fsync: Literal["always", "never"] = Field("always", description="fdatasync each batch of slot writes.")
    io_threads: int = Field(4, ge=1, le=64, description="Threads of this adapter's I/O executor.")
    checkpoint_s: float = Field(
        30.0, gt=0, le=86_400, description="Least time between two checkpoints of the slot index."
    )
    authenticate: bool = Field(
        True,
        description="Sign blobs with the deployment key (l2.auth_keys or <data_dir>/l2.key) and load "
        "only signed ones: a slot planted in the file is never served.",
    )

    @model_validator(mode="after")
    def _aligned(self) -> SlabAdapterConfig:
        if self.slot_bytes % SLAB_ALIGN:
            raise ValueError(f"slot_bytes must be a multiple of {SLAB_ALIGN}")
        if self.size_bytes % SLAB_ALIGN:
            raise ValueError(f"size_bytes must be a multiple of {SLAB_ALIGN}")
        if self.size_bytes < SLAB_ALIGN + self.slot_bytes:
            raise ValueError("size_bytes must hold at least one slot (and the 4 KiB superblock)")
        return self

    def local_paths(self) -> list[Path]:
        return list(self.paths)

    def transfer_threads(self) -> int:
        return self.io_threads
