"""The directories of the disk adapter: their layout, the lock that gives one adapter a directory,
and the scan that rebuilds the index at start. Called only from the adapter's I/O executor.

State: none; every function works on the paths it is given.

On-disk layout of one directory::

    <root>/.lock                 flock-ed while an adapter owns the directory
    <root>/<2 hex>/<name>.kvd    one blob (codec header + payload), exactly the blob's bytes
    <root>/<2 hex>/<name>.tmp    a write in progress; a leftover after a crash, removed at start

Primitives in call order:
  prepare(root)        create root and its 256 subdirectories, take the lock -> fd
                       (ConfigError when another adapter holds it)
  scan(subdir)         remove temp files, validate each blob's header (never the payload), delete
                       files that fail -> ScanReport
  unlink(path)         remove one file, False when it was gone already
  release(fd)          drop the directory lock
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass, field

from app.errors import ConfigError, IntegrityError
from storage import codec

BLOB_SUFFIX = ".kvd"
TMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"
SUBDIRS = tuple(f"{i:02x}" for i in range(256))
_HEADER_PROBE = 4096


@dataclass(frozen=True, slots=True)
class ScannedBlob:
    key: str
    path: str
    size: int
    mtime: float


@dataclass(slots=True)
class ScanReport:
    blobs: list[ScannedBlob] = field(default_factory=list)
    temp_removed: int = 0
    corrupt_removed: int = 0


def prepare(root: str) -> int:
    os.makedirs(root, exist_ok=True)
    for sub in SUBDIRS:
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    fd = os.open(os.path.join(root, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"disk L2 directory {root} is in use by another adapter") from None
    return fd


def release(fd: int) -> None:
    os.close(fd)  # closing the descriptor drops the flock


def scan(subdir: str) -> ScanReport:
    report = ScanReport()
    try:
        entries = list(os.scandir(subdir))
    except FileNotFoundError:
        return report
    for entry in entries:
        if not entry.is_file(follow_symlinks=False):
            continue
        if entry.name.endswith(TMP_SUFFIX):
            unlink(entry.path)
            report.temp_removed += 1
        elif entry.name.endswith(BLOB_SUFFIX):
            blob = _probe(entry.path)
            if blob is None:
                unlink(entry.path)
                report.corrupt_removed += 1
            else:
                report.blobs.append(blob)
    return report


def _probe(path: str) -> ScannedBlob | None:
    """The blob's key and size from its header alone, or None when the file is not whole."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        head = os.pread(fd, _HEADER_PROBE, 0)
        need = codec.header_length(head)
        if need > len(head):
            head = os.pread(fd, need, 0)
        header = codec.read_header(head)
    except (IntegrityError, OSError):
        return None
    finally:
        os.close(fd)
    if st.st_size != header.total_len:
        return None
    return ScannedBlob(key=header.key, path=path, size=st.st_size, mtime=st.st_mtime)


def unlink(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
