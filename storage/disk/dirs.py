"""The directories of the disk adapter: their layout, the lock that gives one adapter a directory,
and the scan that rebuilds the index at start. Called only from the adapter's I/O executor.

State: none; every function works on the paths it is given.

On-disk layout of one directory::

Files are 0600 and directories 0700: blobs are private to the service user.

    <root>/.lock                 flock-ed while an adapter owns the directory
    <root>/<2 hex>/<name>.kvd    one blob (codec header + payload), exactly the blob's bytes
    <root>/<2 hex>/<name>.tmp    a write in progress; a leftover after a crash, removed at start

Primitives in call order:
  prepare(root)        create root and its 256 subdirectories (mode 0700, as is every directory
                       created on the way; existing ones are made 0700), take the lock -> fd
                       (ConfigError when another adapter holds it)
  scan(subdir)         remove temp files, validate each blob's header (never the payload), delete
                       files that fail -> ScanReport
  unlink(path)         remove one file, False when it was gone already
  release(fd)          drop the directory lock
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

from app.errors import ConfigError, IntegrityError
from storage.codec import blob_header
from storage.fsio import lock_exclusive

BLOB_SUFFIX = ".kvd"
TMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"
SUBDIRS = tuple(f"{i:02x}" for i in range(256))
FILE_MODE = 0o600  # blobs and the lock: the service user's alone
DIR_MODE = 0o700
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
    _private_dir(root)
    for sub in SUBDIRS:
        _private_dir(os.path.join(root, sub))
    fd = os.open(os.path.join(root, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        lock_exclusive(fd, f"disk L2 directory {root}")
    except ConfigError:
        os.close(fd)
        raise
    return fd


def _private_dir(path: str) -> None:
    """`path` as a directory of mode 0700: the missing ones on the way created so, `path` itself
    made so when it exists already (its blobs are this adapter's alone)."""
    missing: list[str] = []
    at = os.path.abspath(path)
    while not os.path.isdir(at):
        missing.append(at)
        parent = os.path.dirname(at)
        if parent == at:
            break
        at = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise
    if stat.S_IMODE(os.stat(path).st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)


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
        need = blob_header.header_length(head)
        if need > len(head):
            head = os.pread(fd, need, 0)
        header = blob_header.read_header(head)
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
