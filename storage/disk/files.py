"""BlobFiles: the blocking file operations of the disk adapter. Called only from its I/O executor.

State: the write policy (fsync, O_DIRECT) and, once O_DIRECT was refused by a filesystem, the
reason it is no longer used. Threads share it; the only mutation is that one-way switch. Where
files lie, and the scan at start, are storage/disk/dirs.py.

Primitives in call order:
  write_atomic(path, segments)      temp file (mode 0600) in the same directory, write, fsync
                                    (per policy), rename, fsync of the directory (per policy):
                                    readers see the whole blob or nothing, and after a crash the
                                    blob is there or not, never a name without its bytes. fsync is
                                    `sync_fd` (os.fsync; tests pass their own to observe it)
  read(path, size)                  the blob's bytes; None if the file is gone; BadFile if its size
                                    differs from what the index recorded (truncated, replaced)
  read_into(path, size, head_len, out)
                                    for load_into: a raw blob whose payload is exactly len(out) has
                                    its header read into small memory and its payload straight into
                                    out -> Placed(header); any other blob -> its bytes, as read does.
                                    None and BadFile (also for a file that ends early) as for read;
                                    BadFile, nothing read, for a file longer than any blob for out
                                    (its size is the index's, checked against fstat before a read)
  remove(paths)                     unlink, ignoring files already gone

Every read that must fill a buffer goes through one loop (`_read_full`), which says BadFile when
the file ends early.

O_DIRECT: writes go through a page-aligned bounce buffer, padded to ALIGN and truncated back;
reads land in an aligned buffer (read_into: the per-thread bounce buffer, copied into out, since
the payload's file offset and out's address cannot both be aligned). When a filesystem answers
EINVAL, the file is redone without O_DIRECT and O_DIRECT stays off (`direct_fallback` says why).
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from storage.codec import blob_header
from storage.disk.dirs import DIR_MODE, FILE_MODE, TMP_SUFFIX, unlink
from storage.fsio import sync_directory
from storage.inflight import Placed

ALIGN = 4096
BOUNCE_BYTES = 8 << 20
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)

T = TypeVar("T")


class BadFile(Exception):
    """The file exists but is not the blob the index expects."""


class _DirectRefused(Exception):
    """The filesystem refused an O_DIRECT transfer (EINVAL)."""


def _fresh_buffer(size: int) -> mmap.mmap:
    """Page-aligned anonymous memory, faulted in up front (one syscall, not one fault per page)."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_POPULATE)


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _write_all(fd: int, segments: Sequence[blob_header.Buffer]) -> None:
    views = [memoryview(s).cast("B") for s in segments]
    views = [v for v in views if v.nbytes]
    while views:
        written = os.writev(fd, views)
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def _open_sized(path: str, size: int, *, direct: bool = False) -> int | None:
    """The file opened for reading (O_DIRECT when asked) after checking its size; None when it
    vanished. `_DirectRefused` when the filesystem does not do O_DIRECT."""
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if direct and exc.errno == errno.EINVAL:
            raise _DirectRefused from None
        raise
    if os.fstat(fd).st_size != size:
        os.close(fd)
        raise BadFile(f"{path}: size differs from the index")
    return fd


def _read_full(
    fd: int, path: str, view: memoryview, offset: int, need: int | None = None, *, direct: bool = False
) -> None:
    """Read the file from `offset` into `view` until `need` bytes (all of view by default) are in:
    the one read-until-full loop. BadFile when the file ends first; under O_DIRECT (`direct`),
    _DirectRefused when the filesystem answers EINVAL."""
    need = view.nbytes if need is None else need
    got = 0
    while got < need:
        try:
            n = os.preadv(fd, [view[got:]], offset + got)
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                raise _DirectRefused from None
            raise
        if n == 0:
            raise BadFile(f"{path}: shorter than the index says")
        got += n


def _pread_all(fd: int, path: str, length: int, offset: int) -> bytes:
    """`length` bytes of the file from `offset` as new bytes: one pread, the loop after a short one."""
    data = os.pread(fd, length, offset)
    if len(data) == length:
        return data
    buf = bytearray(length)
    buf[: len(data)] = data
    _read_full(fd, path, memoryview(buf)[len(data) :], offset + len(data))
    return bytes(buf)


class BlobFiles:
    """File I/O of one disk adapter, safe to call from several executor threads at once."""

    def __init__(self, *, fsync: bool, direct: bool, sync_fd: Callable[[int], None] = os.fsync) -> None:
        self.fsync = fsync
        self._sync_fd = sync_fd
        self.direct = direct
        self.direct_fallback: str | None = None
        self._names = itertools.count()
        self._local = threading.local()

    # --- blobs ---------------------------------------------------------------------------------

    def write_atomic(self, path: str, segments: Sequence[blob_header.Buffer]) -> None:
        tmp = f"{path}.{os.getpid()}-{next(self._names)}{TMP_SUFFIX}"
        if self.direct:
            try:
                self._write_file(tmp, segments, direct=True)
            except _DirectRefused:
                self._disable_direct("write")
                self._write_file(tmp, segments, direct=False)
        else:
            self._write_file(tmp, segments, direct=False)
        try:
            os.rename(tmp, path)
        except BaseException:
            unlink(tmp)
            raise
        if self.fsync:  # the rename itself survives a crash only once its directory is synced
            sync_directory(os.path.dirname(path), self._sync_fd)

    def _write_file(self, tmp: str, segments: Sequence[blob_header.Buffer], *, direct: bool) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
        try:
            try:
                fd = os.open(tmp, flags, FILE_MODE)
            except FileNotFoundError:  # its subdirectory was removed behind our back
                os.makedirs(os.path.dirname(tmp), DIR_MODE, exist_ok=True)
                fd = os.open(tmp, flags, FILE_MODE)
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                raise _DirectRefused from None
            raise
        try:
            if direct:
                self._write_direct(fd, segments)
            else:
                _write_all(fd, segments)
            if self.fsync:
                self._sync_fd(fd)
        except BaseException:
            os.close(fd)
            unlink(tmp)
            raise
        os.close(fd)

    def _write_direct(self, fd: int, segments: Sequence[blob_header.Buffer]) -> None:
        bounce = self._bounce()
        filled = 0
        total = 0
        try:
            for segment in segments:
                view = memoryview(segment).cast("B")
                while view.nbytes:
                    take = min(view.nbytes, BOUNCE_BYTES - filled)
                    bounce[filled : filled + take] = view[:take]
                    filled += take
                    view = view[take:]
                    if filled == BOUNCE_BYTES:
                        total += self._direct_out(fd, bounce, filled, total)
                        filled = 0
            if filled:
                total += self._direct_out(fd, bounce, filled, total)
                os.ftruncate(fd, total - _round_up(filled) + filled)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise _DirectRefused from None
            raise

    @staticmethod
    def _direct_out(fd: int, bounce: mmap.mmap, filled: int, offset: int) -> int:
        length = _round_up(filled)
        if length > filled:
            bounce[filled:length] = bytes(length - filled)
        view = memoryview(bounce)[:length]
        try:
            done = 0
            while done < length:
                done += os.pwrite(fd, view[done:], offset + done)
        finally:
            view.release()
        return length

    def _bounce(self) -> mmap.mmap:
        buf: mmap.mmap | None = getattr(self._local, "bounce", None)
        if buf is None:
            buf = _fresh_buffer(BOUNCE_BYTES)
            self._local.bounce = buf
        return buf

    def read(self, path: str, size: int) -> bytes | memoryview | None:
        def buffered(fd: int) -> bytes | memoryview:
            return _pread_all(fd, path, size, 0)

        return self._read(path, size, lambda: self._read_direct(path, size), buffered)

    def read_into(
        self, path: str, size: int, head_len: int, out: memoryview
    ) -> Placed | bytes | memoryview | None:
        if size > head_len + out.nbytes:  # no blob for out is that long: not read at all
            raise BadFile(f"{path}: {size} bytes, a blob of this chunk has at most {head_len + out.nbytes}")
        if size != head_len + out.nbytes:
            return self.read(path, size)

        def buffered(fd: int) -> Placed | bytes:
            head = _pread_all(fd, path, head_len, 0)
            if not blob_header.fits_in_place(head, out.nbytes):
                return head + _pread_all(fd, path, size - head_len, head_len)
            _read_full(fd, path, out, head_len)
            return Placed(head)

        return self._read(path, size, lambda: self._read_into_direct(path, size, head_len, out), buffered)

    def _read(
        self, path: str, size: int, direct: Callable[[], T | None], buffered: Callable[[int], T]
    ) -> T | None:
        """`direct()` while O_DIRECT is on (turned off for good when the filesystem refuses it),
        else `buffered(fd)` on the file opened for reading; None when the file is gone."""
        if self.direct:
            try:
                return direct()
            except _DirectRefused:
                self._disable_direct("read")
        fd = _open_sized(path, size)
        if fd is None:
            return None
        try:
            return buffered(fd)
        finally:
            os.close(fd)

    def _read_into_direct(
        self, path: str, size: int, head_len: int, out: memoryview
    ) -> Placed | memoryview | None:
        fd = _open_sized(path, size, direct=True)
        if fd is None:
            return None
        try:
            with memoryview(self._bounce()) as bounce:
                head = self._direct_blocks_into(fd, path, bounce, head_len, out)
        finally:
            os.close(fd)
        return Placed(head) if head is not None else self._read_direct(path, size)

    @staticmethod
    def _direct_blocks_into(
        fd: int, path: str, bounce: memoryview, head_len: int, out: memoryview
    ) -> bytes | None:
        """Aligned reads through `bounce`: the header is returned, the payload copied into out.
        None (nothing copied) when the header says the blob does not fit in place."""
        size = head_len + out.nbytes
        head = b""
        offset = 0
        while offset < size:
            want = min(BOUNCE_BYTES, _round_up(size - offset))
            try:
                n = os.preadv(fd, [bounce[:want]], offset)
            except OSError as exc:
                if exc.errno == errno.EINVAL:
                    raise _DirectRefused from None
                raise
            got = min(n, size - offset)
            if got == 0 or (got < size - offset and n % ALIGN) or (offset == 0 and got < head_len):
                raise BadFile(f"{path}: shorter than the index says")
            if offset == 0:  # the header lies in the first block
                head = bytes(bounce[:head_len])
                if not blob_header.fits_in_place(head, out.nbytes):
                    return None
                out[: got - head_len] = bounce[head_len:got]
            else:
                out[offset - head_len : offset - head_len + got] = bounce[:got]
            offset += got
        return head

    def _read_direct(self, path: str, size: int) -> memoryview | None:
        fd = _open_sized(path, size, direct=True)
        if fd is None:
            return None
        try:
            view = memoryview(_fresh_buffer(max(_round_up(size), ALIGN)))
            _read_full(fd, path, view, 0, size, direct=True)  # whole aligned blocks at a time
            return view[:size]
        finally:
            os.close(fd)

    def _disable_direct(self, where: str) -> None:
        self.direct = False
        self.direct_fallback = f"O_DIRECT refused (EINVAL) on {where}; using buffered I/O"

    # --- removal -------------------------------------------------------------------------------

    @staticmethod
    def remove(paths: Sequence[str]) -> int:
        return sum(1 for path in paths if unlink(path))
