"""The disk adapter's config: where its files live, how much it keeps, how it writes them.

Read by storage/disk/ (the adapter, its files and directories); listed in storage/registry.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from storage.config import AdapterConfigBase, AdapterName


class DiskAdapterConfig(AdapterConfigBase):
    """Local-disk L2: crash-safe files, index rebuilt from the files at start."""

    type: Literal["disk"] = "disk"
    name: AdapterName = "disk"
    paths: list[Path] = Field(
        default_factory=list, max_length=64, description="Directories; empty = <data_dir>/l2-disk."
    )
    capacity_gb: float = Field(8.0, gt=0, le=1 << 20, description="LRU eviction keeps usage below this.")
    fsync: Literal["always", "never"] = Field("always", description="fsync each blob before rename.")
    o_direct: bool = Field(False, description="Use O_DIRECT where the filesystem allows it.")
    io_threads: int = Field(4, ge=1, le=64, description="Threads of this adapter's file I/O executor.")
    authenticate: bool = Field(
        True,
        description="Sign blobs with the deployment key (l2.auth_keys or <data_dir>/l2.key) and load "
        "only signed ones: a blob planted in the directory is never served. Files are 0600 either way.",
    )

    def local_paths(self) -> list[Path]:
        return list(self.paths)

    def transfer_threads(self) -> int:
        return self.io_threads
