"""CUDA IPC handles checked before use: every field an engine sends, then the allocation it names.

torch's own rebuild (`rebuild_cuda_tensor`) trusts its fields: storage size and offsets are not
checked against the allocation they open, and the ref-counter fields name a shared-memory file and
an offset that the receiver decrements on release (and at once, for a handle it already opened) —
a client-chosen write into the sidecar's memory. Here:

- `validate(handle)` (pure, no CUDA): known kind and dtype; a contiguous shape/stride; every size
  and offset non-negative and bounded; the tensor within its storage; the ref-counter fields are
  ignored (never passed to torch).
- `within_allocation(ptr, nbytes, base, size)` (pure): the opened storage lies inside the
  allocation the driver reports (`driver_address_range`, cuMemGetAddressRange) — checked after
  the IPC handle is opened and before any byte is touched.
- `RefCounter`: a ref-counter file the sidecar creates itself, the one torch is given.

No state but the RefCounter's file. Called from the event loop (at registration).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvdepot_connector.layout import DTYPE_SIZES

#: the largest storage a handle may name (above any GPU's memory)
MAX_STORAGE_BYTES = 1 << 40
MAX_DEVICE = 64
IPC_HANDLE_MAX = 256  # a CUDA IPC handle is 64 bytes; torch's expandable segments send more
EVENT_HANDLE_SIZE = 64
#: int64 counters in a torch ref-counter file (torch::CUDA_IPC_REF_COUNTER_FILE_SIZE)
REF_COUNTER_SLOTS = 10000


class CudaHandleError(ValueError):
    """A CUDA IPC handle whose fields do not describe a tensor inside its allocation."""


@dataclass(frozen=True, slots=True)
class CudaIpcFields:
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # elements into the storage
    device: int
    ipc_handle: bytes
    storage_bytes: int
    storage_offset_bytes: int
    event_handle: bytes | None
    event_sync_required: bool

    @property
    def tensor_bytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def _int(handle: dict[str, Any], key: str, default: int | None = None) -> int:
    value = handle.get(key, default)
    if type(value) is not int:  # bool and float are not sizes
        raise CudaHandleError(f"{key} must be an integer, not {type(value).__name__}")
    if value < 0:
        raise CudaHandleError(f"{key} must not be negative")
    return value


def _ints(handle: dict[str, Any], key: str) -> tuple[int, ...]:
    value = handle.get(key)
    if not isinstance(value, list | tuple) or not 1 <= len(value) <= 8:
        raise CudaHandleError(f"{key} must be a list of 1 to 8 integers")
    if any(type(v) is not int or v < 0 for v in value):
        raise CudaHandleError(f"{key} must hold non-negative integers")
    return tuple(value)


def _bytes(handle: dict[str, Any], key: str, limit: int) -> bytes:
    value = handle.get(key, b"")
    if not isinstance(value, bytes) or len(value) > limit:
        raise CudaHandleError(f"{key} must be at most {limit} bytes")
    return value


def validate(handle: dict[str, Any], *, max_storage_bytes: int = MAX_STORAGE_BYTES) -> CudaIpcFields:
    """The handle's fields, each checked; CudaHandleError names the first that is wrong."""
    if handle.get("kind") != "cuda-ipc":
        raise CudaHandleError(f"the CUDA device opens cuda-ipc handles, not {handle.get('kind')!r}")
    dtype = handle.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise CudaHandleError(f"unknown dtype {dtype!r}")
    shape, stride = _ints(handle, "shape"), _ints(handle, "stride")
    if len(shape) != len(stride) or 0 in shape:
        raise CudaHandleError("shape and stride must have the same length, every dimension positive")
    expected, step = [], 1
    for d in reversed(shape):
        expected.append(step)
        step *= d
    if stride != tuple(reversed(expected)):
        raise CudaHandleError(f"the tensor must be contiguous: stride {list(stride)} for shape {list(shape)}")
    offset = _int(handle, "offset", 0)
    device = _int(handle, "device", 0)
    if device >= MAX_DEVICE:
        raise CudaHandleError(f"device {device} out of range")
    storage_bytes = _int(handle, "storage_bytes")
    storage_offset = _int(handle, "storage_offset_bytes")
    if not 0 < storage_bytes <= max_storage_bytes or storage_offset > max_storage_bytes:
        raise CudaHandleError(f"storage of {storage_bytes} bytes at {storage_offset}: out of bounds")
    ipc = _bytes(handle, "ipc_handle", IPC_HANDLE_MAX)
    if not ipc:
        raise CudaHandleError("ipc_handle is empty")
    event = _bytes(handle, "event_handle", EVENT_HANDLE_SIZE)
    if event and len(event) != EVENT_HANDLE_SIZE:
        raise CudaHandleError(f"event_handle must be {EVENT_HANDLE_SIZE} bytes")
    sync = handle.get("event_sync_required", False)
    if not isinstance(sync, bool):
        raise CudaHandleError("event_sync_required must be a boolean")
    fields = CudaIpcFields(
        dtype=dtype, shape=shape, stride=stride, offset=offset, device=device, ipc_handle=ipc,
        storage_bytes=storage_bytes, storage_offset_bytes=storage_offset, event_handle=event or None,
        event_sync_required=sync and bool(event),
    )  # fmt: skip
    end = offset * DTYPE_SIZES[dtype] + fields.tensor_bytes
    if end > storage_bytes:
        raise CudaHandleError(f"the tensor reaches byte {end} of a storage of {storage_bytes}")
    return fields


def within_allocation(ptr: int, nbytes: int, base: int, size: int) -> bool:
    """Whether [ptr, ptr + nbytes) lies inside the allocation [base, base + size)."""
    return nbytes >= 0 and size > 0 and base <= ptr and ptr + nbytes <= base + size


def driver_address_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the device allocation holding `ptr`, as the CUDA driver reports it."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CudaHandleError(f"cannot ask the CUDA driver: {exc}") from None
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    err = lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if err != 0:
        raise CudaHandleError(f"the CUDA driver knows no allocation at {ptr:#x} (error {err})")
    return int(base.value), int(size.value)


class RefCounter:
    """A torch ref-counter file owned by the sidecar: what torch decrements when an opened
    storage is released, instead of a file and offset the client chose."""

    def __init__(self, shm_dir: Path = Path("/dev/shm")) -> None:
        self.name = f"kvdepot-refcount-{os.getpid()}-{secrets.token_hex(8)}"
        self._path = shm_dir / self.name
        fd = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, 8 * REF_COUNTER_SLOTS)
        finally:
            os.close(fd)

    @property
    def handle(self) -> bytes:
        return f"/{self.name}".encode()

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()
