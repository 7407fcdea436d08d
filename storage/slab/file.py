"""SlabFile: the blocking I/O of one slab file or block device. Called only from the slab
adapter's I/O executor (several threads at once: every transfer is a positioned read or write).

State: the open descriptor (O_DIRECT, flock-ed: one adapter per file), the superblock, and per
thread the aligned buffers O_DIRECT needs (anonymous mmaps: page aligned). The format is
storage/slab/headers.py.

Primitives in call order:
  SlabFile.open(path, size_bytes, slot_bytes)
                      a new file: created (0600), preallocated (posix_fallocate) and formatted; an
                      existing one: its superblock checked. A block device: its own size, formatted
                      when its first block is all zeros. ConfigError, naming the path, for a file that
                      is foreign, damaged, of another size or slot size, in use, or on a filesystem
                      without O_DIRECT; one without a superblock is formatted only when its first and
                      last MiB are zeros
  scan()              every slot's head read and checked -> ScanResult
  write_slot(slot, head, payload)
                      head (slot header + blob header) and payload in one positioned write; the
                      payload goes straight from the caller's memory when it is aligned, else
                      through the thread's bounce buffer
  read_into(slot, area, out) -> head area bytes
                      the slot's head area, and its payload straight into out when out is aligned
                      (else through the bounce buffer)
  read_blob(slot, area, payload_len) -> (head area, blob)
                      the whole blob, contiguous, in fresh aligned memory
  invalidate(slot)    zero the slot's first block: the slot is empty after a crash too
  sync()              fdatasync
  close()             the descriptor (and its lock) released
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import secrets
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from app.errors import ConfigError
from storage.fsio import lock_exclusive, sync_directory
from storage.slab import headers as fmt
from storage.slab.headers import ALIGN, SlabFormatError, SlotHeader, round_up

BOUNCE_BYTES = 8 << 20
BLANK_CHECK_BYTES = 1 << 20  # a file or device is formatted only when both ends are this blank
HEAD_BYTES = 80 << 10  # the largest head area: both headers with the longest key, rounded up
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_ZERO_BLOCK = bytes(ALIGN)


class SlotReadError(Exception):
    """A slot read ended early (the file is shorter than its superblock says)."""


@dataclass(frozen=True, slots=True)
class ScannedSlot:
    slot: int
    key: str
    header: SlotHeader


@dataclass(slots=True)
class ScanResult:
    slots: list[ScannedSlot] = field(default_factory=list)
    empty: int = 0
    invalid: int = 0


def aligned_buffer(size: int) -> mmap.mmap:
    """Page-aligned anonymous memory of at least `size` bytes, faulted in up front."""
    return mmap.mmap(
        -1, max(round_up(size), ALIGN), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_POPULATE
    )


def address_of(view: memoryview) -> int:
    """The address of a contiguous buffer's first byte."""
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    import numpy as np  # read-only buffers only; numpy is imported where it is needed

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def is_aligned(view: memoryview) -> bool:
    return view.nbytes > 0 and view.contiguous and address_of(view) % ALIGN == 0


def _transfer_all(call: str, fd: int, views: Sequence[memoryview], offset: int) -> None:
    """preadv/pwritev until every view is done; SlotReadError when a read hits the end."""
    pending = [v for v in views if v.nbytes]
    while pending:
        n = os.preadv(fd, pending, offset) if call == "read" else os.pwritev(fd, pending, offset)
        if n == 0:
            raise SlotReadError("slab file ends before the slot does")
        offset += n
        while pending and n >= pending[0].nbytes:
            n -= pending[0].nbytes
            pending.pop(0)
        if pending and n:
            pending[0] = pending[0][n:]


def _blank_ends(fd: int, size: int) -> bool:
    """Whether the first and the last BLANK_CHECK_BYTES are zeros: where filesystems, partition
    tables and volume labels keep their signatures (btrfs at 64 KiB, a GPT copy at the end)."""
    span = min(BLANK_CHECK_BYTES, size // ALIGN * ALIGN)
    buf = aligned_buffer(span)
    zeros = bytes(span)
    for offset in sorted({0, (size - span) // ALIGN * ALIGN}):
        _transfer_all("read", fd, [memoryview(buf)[:span]], offset)
        if buf[:span] != zeros:
            return False
    return True


def _open_direct(path: str, flags: int, mode: int = 0o600) -> int:
    try:
        return os.open(path, flags | os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT, mode)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise ConfigError(f"slab {path}: its filesystem does not support O_DIRECT (tmpfs?)") from None
        raise ConfigError(f"slab {path}: cannot open: {exc.strerror}") from None


class SlabFile:
    def __init__(self, path: str, fd: int, superblock: fmt.Superblock, *, device: bool) -> None:
        self.path = path
        self.fd = fd
        self.superblock = superblock
        self.device = device
        self.file_id = superblock.file_id
        self.slots = superblock.slots
        self.slot_bytes = superblock.slot_bytes
        self._local = threading.local()

    # --- open and format -----------------------------------------------------------------------

    @classmethod
    def open(cls, path: str, size_bytes: int, slot_bytes: int) -> SlabFile:
        created = False
        try:
            st = os.stat(path)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(os.path.abspath(path)), 0o700, exist_ok=True)
            fd = _open_direct(path, os.O_CREAT | os.O_EXCL)
            created = True
        else:
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
                raise ConfigError(f"slab {path}: neither a regular file nor a block device")
            fd = _open_direct(path, 0)
        try:
            lock_exclusive(fd, f"slab {path}")
            return cls._opened(path, fd, size_bytes, slot_bytes, created)
        except BaseException:
            os.close(fd)
            if created:
                os.unlink(path)
            raise

    @classmethod
    def _opened(cls, path: str, fd: int, size_bytes: int, slot_bytes: int, created: bool) -> SlabFile:
        st = os.fstat(fd)
        device = stat.S_ISBLK(st.st_mode)
        size = os.lseek(fd, 0, os.SEEK_END) if device else st.st_size
        if not device and size == 0:
            try:
                os.posix_fallocate(fd, 0, size_bytes)
            except OSError as exc:
                raise ConfigError(
                    f"slab {path}: cannot preallocate {size_bytes} bytes: {exc.strerror}"
                ) from None
            size = size_bytes
        first = aligned_buffer(ALIGN)
        _transfer_all("read", fd, [memoryview(first)], 0)
        if bytes(first) == _ZERO_BLOCK:  # fresh (never formatted), when its ends are blank too
            if not device and size != size_bytes:
                raise ConfigError(f"slab {path} is {size} bytes; size_bytes says {size_bytes}")
            if not _blank_ends(fd, size):
                raise ConfigError(
                    f"slab {path}: not a kvdepot slab, and not blank (data in its first or last MiB); "
                    "refusing to overwrite it (zero it, e.g. blkdiscard, or name another path)"
                )
            superblock = cls._format(path, fd, size, slot_bytes, created)
        else:
            try:
                superblock = fmt.parse_super(memoryview(first))
            except SlabFormatError as exc:
                raise ConfigError(
                    f"slab {path}: {exc}; refusing to overwrite it (remove it or name another path)"
                ) from None
            if superblock.slot_bytes != slot_bytes:
                raise ConfigError(
                    f"slab {path} was formatted with slot_bytes {superblock.slot_bytes}; "
                    f"the config says {slot_bytes}"
                )
            if superblock.file_bytes != size:
                raise ConfigError(f"slab {path} is {size} bytes; its superblock says {superblock.file_bytes}")
            if not device and size != size_bytes:
                raise ConfigError(f"slab {path} is {size} bytes; size_bytes says {size_bytes}")
        return cls(path, fd, superblock, device=device)

    @staticmethod
    def _format(path: str, fd: int, size: int, slot_bytes: int, created: bool) -> fmt.Superblock:
        slots = fmt.slot_count(size, slot_bytes)
        if slots < 1:
            raise ConfigError(f"slab {path}: {size} bytes hold no slot of {slot_bytes} bytes")
        superblock = fmt.Superblock(slot_bytes, slots, size, secrets.token_bytes(16))
        block = aligned_buffer(ALIGN)
        packed = fmt.pack_super(slot_bytes, slots, size, superblock.file_id)
        block[: len(packed)] = packed
        _transfer_all("write", fd, [memoryview(block)], 0)
        os.fdatasync(fd)
        if created:  # the new name survives a crash once its directory is synced
            sync_directory(os.path.dirname(os.path.abspath(path)))
        return superblock

    # --- buffers -------------------------------------------------------------------------------

    def _buffer(self, name: str, size: int) -> mmap.mmap:
        buf: mmap.mmap | None = getattr(self._local, name, None)
        if buf is None or len(buf) < size:
            buf = aligned_buffer(size)
            setattr(self._local, name, buf)
        return buf

    def offset(self, slot: int) -> int:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} outside 0..{self.slots - 1}")
        return ALIGN + slot * self.slot_bytes

    # --- slots ---------------------------------------------------------------------------------

    def scan(self) -> ScanResult:
        result = ScanResult()
        block = memoryview(self._buffer("head", HEAD_BYTES))
        for slot in range(self.slots):
            at = self.offset(slot)
            _transfer_all("read", self.fd, [block[:ALIGN]], at)
            header = fmt.parse_slot(block[:ALIGN], self.file_id, slot)
            if header is None:
                if bytes(block[:ALIGN]) == _ZERO_BLOCK:
                    result.empty += 1
                else:
                    result.invalid += 1
                continue
            area = fmt.payload_offset(header.blob_head_len)
            if area > HEAD_BYTES or fmt.slot_need(header.blob_head_len, header.payload_len) > self.slot_bytes:
                result.invalid += 1
                continue
            if area > ALIGN:
                _transfer_all("read", self.fd, [block[ALIGN:area]], at + ALIGN)
            found = fmt.slot_blob(block[:area], header)
            if found is None:
                result.invalid += 1
            else:
                result.slots.append(ScannedSlot(slot, found[0], header))
        return result

    def write_slot(self, slot: int, head: bytes, payload: memoryview) -> None:
        at = self.offset(slot)
        area = round_up(len(head))
        if area + round_up(payload.nbytes) > self.slot_bytes:
            raise ValueError("blob larger than the slot")
        hbuf = self._buffer("head", HEAD_BYTES)
        hbuf[: len(head)] = head
        hbuf[len(head) : area] = bytes(area - len(head))
        hview = memoryview(hbuf)[:area]
        body = payload.nbytes // ALIGN * ALIGN
        if body and is_aligned(payload):
            views = [hview, payload[:body]]
            tail = payload[body:]
            if tail.nbytes:
                tbuf = self._buffer("tail", ALIGN)
                tbuf[: tail.nbytes] = tail
                tbuf[tail.nbytes :] = bytes(ALIGN - tail.nbytes)
                views.append(memoryview(tbuf))
            _transfer_all("write", self.fd, views, at)
            return
        _transfer_all("write", self.fd, [hview], at)
        bounce = self._buffer("bounce", BOUNCE_BYTES)
        done = 0
        while done < payload.nbytes:
            take = min(BOUNCE_BYTES, payload.nbytes - done)
            bounce[:take] = payload[done : done + take]
            padded = round_up(take)
            if padded > take:
                bounce[take:padded] = bytes(padded - take)
            _transfer_all("write", self.fd, [memoryview(bounce)[:padded]], at + area + done)
            done += take

    def read_into(self, slot: int, area: int, out: memoryview) -> bytes:
        """The slot's first `area` bytes (its headers), and its payload (len(out) bytes) in out."""
        at = self.offset(slot)
        hview = memoryview(self._buffer("head", HEAD_BYTES))[:area]
        body = out.nbytes // ALIGN * ALIGN
        if body and is_aligned(out):
            views = [hview, out[:body]]
            tail = out.nbytes - body
            tbuf = self._buffer("tail", ALIGN)
            if tail:
                views.append(memoryview(tbuf))
            _transfer_all("read", self.fd, views, at)
            if tail:
                out[body:] = tbuf[:tail]
            return bytes(hview)
        _transfer_all("read", self.fd, [hview], at)
        head = bytes(hview)
        bounce = self._buffer("bounce", BOUNCE_BYTES)
        done = 0
        while done < out.nbytes:
            take = min(BOUNCE_BYTES, out.nbytes - done)
            _transfer_all("read", self.fd, [memoryview(bounce)[: round_up(take)]], at + area + done)
            out[done : done + take] = bounce[:take]
            done += take
        return head

    def read_blob(self, slot: int, area: int, head_len: int, payload_len: int) -> tuple[bytes, memoryview]:
        """The slot's head area and its blob (blob header + payload), contiguous, in fresh memory."""
        buf = memoryview(aligned_buffer(area + round_up(payload_len)))
        _transfer_all("read", self.fd, [buf], self.offset(slot))
        head = bytes(buf[:area])
        start = area - head_len  # the blob header moved to just before the payload
        buf[start:area] = head[fmt.SLOT_HEADER_SIZE : fmt.SLOT_HEADER_SIZE + head_len]
        return head, buf[start : area + payload_len]

    def invalidate(self, slot: int) -> None:
        block = self._buffer("zero", ALIGN)
        block[:] = _ZERO_BLOCK
        _transfer_all("write", self.fd, [memoryview(block)[:ALIGN]], self.offset(slot))

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
