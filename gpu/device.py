"""Devices for the sidecar's own copies between an engine's KV cache and the L1 arena.

A device opens the tensors an engine shared with the sidecar (`open`), pins host memory for fast
transfers (`pin`), queues copies on a stream (`copy`) and records an event after them (`record`)
whose `synchronize` blocks until they are done. The event loop never calls `synchronize`: the
transfer engine (gpu/transfer.py) waits on it in an executor.

- `CudaDevice`: CUDA streams and events; tensors shared as CUDA IPC handles, every field checked
  and the storage checked against its allocation before use (gpu/cuda_ipc.py); host memory
  pinned with cudaHostRegister. Built only where torch sees a GPU.
- `CpuDevice`: the same path on CPU. A stream is a queue of copies, `record` closes a batch, and
  `synchronize` performs the batch's copies, in the calling (executor) thread. Tensors lie in
  sealed memfd regions the engine shared over its lifeline (gpu/sealed.py), never in files
  opened by name.

Tensor handles are plain dicts (from the data plane): {"kind": "cpu-memfd" | "cuda-ipc", "shape",
"stride", "dtype", "offset" (elements), ...kind-specific fields}; "name" names a sealed region
of the engine instance (`holder`) that opens it.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch

from gpu.cuda_ipc import CudaHandleError, RefCounter, driver_address_range, validate, within_allocation
from gpu.sealed import SealedRegions, SealError
from kvdepot_connector.layout import DTYPE_SIZES

# Every dtype a KV layout may name, as torch's dtype of the same name.
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES}


class Event(Protocol):
    def synchronize(self) -> None: ...


class Stream(Protocol):
    pass


class Device(Protocol):
    kind: str

    def open(self, handle: dict[str, Any], holder: object) -> torch.Tensor: ...

    def close(self, tensor: torch.Tensor) -> None: ...

    def pin(self, host: torch.Tensor) -> None: ...

    def unpin(self, host: torch.Tensor) -> None: ...

    def new_stream(self) -> Stream: ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None: ...

    def record(self, stream: Stream) -> Event: ...


class HandleError(ValueError):
    """A tensor handle that cannot be opened (wrong kind, bad fields, region too small)."""


def _view(base: torch.Tensor, handle: dict[str, Any]) -> torch.Tensor:
    try:
        dtype = DTYPES[str(handle["dtype"])]
        shape = [int(x) for x in handle["shape"]]
        stride = [int(x) for x in handle["stride"]]
        offset = int(handle.get("offset", 0))
    except (KeyError, TypeError, ValueError) as exc:
        raise HandleError(f"bad tensor handle: {exc}") from None
    if len(shape) != len(stride) or not shape or any(d <= 0 for d in shape) or any(s < 0 for s in stride):
        raise HandleError("bad tensor handle: shape and stride")
    typed = base.view(dtype)
    last = offset + sum((d - 1) * s for d, s in zip(shape, stride, strict=True))
    if offset < 0 or last >= typed.numel():
        raise HandleError(f"tensor handle reaches element {last} of a region of {typed.numel()}")
    return typed.as_strided(shape, stride, offset)


class _CpuStream:
    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []


class _CpuEvent:
    def __init__(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._copies = copies

    def synchronize(self) -> None:
        copies, self._copies = self._copies, []
        for dst, src in copies:
            dst.copy_(src)


class CpuDevice:
    """The CPU stub: streams queue copies, events perform them when synchronized."""

    kind = "cpu"

    def __init__(self, regions: SealedRegions | None = None) -> None:
        self.regions = regions if regions is not None else SealedRegions()

    def open(self, handle: dict[str, Any], holder: object) -> torch.Tensor:
        """A view into the region `handle` names among those `holder` (the registering engine
        instance) shared: never another instance's region of the same name."""
        kind = handle.get("kind")
        if kind == "cpu-shm":
            raise HandleError("named shared memory is not opened: share a sealed memfd over the lifeline")
        if kind != "cpu-memfd":
            raise HandleError(f"the CPU device opens cpu-memfd handles, not {kind!r}")
        try:
            mm = self.regions.get(holder, str(handle.get("name", "")))
        except SealError as exc:
            raise HandleError(str(exc)) from None
        # The tensor's storage holds a reference to the mapping: it is unmapped once the last
        # view is gone and the region was dropped (nothing here keeps it longer).
        return _view(torch.frombuffer(mm, dtype=torch.uint8), handle)

    def close(self, tensor: torch.Tensor) -> None:
        return None

    def pin(self, host: torch.Tensor) -> None:
        return None

    def unpin(self, host: torch.Tensor) -> None:
        return None

    def new_stream(self) -> _CpuStream:
        return _CpuStream()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        assert isinstance(stream, _CpuStream)
        stream.pending.append((dst, src))

    def record(self, stream: Stream) -> _CpuEvent:
        assert isinstance(stream, _CpuStream)
        copies, stream.pending = stream.pending, []
        return _CpuEvent(copies)


class CudaDevice:
    """CUDA: copies on the sidecar's own streams, completion awaited through an executor."""

    kind = "cuda"

    def __init__(self, index: int = 0) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
        self.index = index
        self._pinned: set[int] = set()
        self._refs = RefCounter()
        weakref.finalize(self, self._refs.close)

    def open(self, handle: dict[str, Any], holder: object) -> torch.Tensor:
        """Every field checked (gpu/cuda_ipc.py) before torch sees one; torch gets the sidecar's own
        ref counter; the opened storage is checked against the allocation the driver reports."""
        try:
            f = validate(handle)
            if f.device >= torch.cuda.device_count():
                raise CudaHandleError(f"no CUDA device {f.device}")
        except CudaHandleError as exc:
            raise HandleError(str(exc)) from None
        try:
            torch.cuda._lazy_init()  # type: ignore[no-untyped-call]
            storage = torch.UntypedStorage._new_shared_cuda(
                f.device, f.ipc_handle, f.storage_bytes, f.storage_offset_bytes, self._refs.handle, 0,
                f.event_handle, f.event_sync_required,
            )  # fmt: skip
            ptr = int(storage.data_ptr())
            base, size = driver_address_range(ptr)
            if not within_allocation(ptr, f.storage_bytes, base, size):
                raise CudaHandleError(
                    f"storage of {f.storage_bytes} bytes at {ptr:#x} overruns its allocation "
                    f"[{base:#x}, +{size})"
                )
            dtype = DTYPES[f.dtype]
            typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)  # type: ignore[no-untyped-call]
            rebuild = torch._utils._rebuild_tensor
            tensor: torch.Tensor = rebuild(typed, f.offset, f.shape, f.stride)  # type: ignore[no-untyped-call]
        except CudaHandleError as exc:
            raise HandleError(str(exc)) from None
        except (TypeError, ValueError, RuntimeError) as exc:
            raise HandleError(f"cannot open CUDA IPC handle: {exc}") from None
        return tensor

    def close(self, tensor: torch.Tensor) -> None:
        return None

    def pin(self, host: torch.Tensor) -> None:
        if host.data_ptr() in self._pinned:
            return
        err = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
            host.data_ptr(), host.numel() * host.element_size(), 0
        )
        if int(err) == 0:
            self._pinned.add(host.data_ptr())

    def unpin(self, host: torch.Tensor) -> None:
        if host.data_ptr() in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(host.data_ptr())  # type: ignore[no-untyped-call]
            self._pinned.discard(host.data_ptr())

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.index)  # type: ignore[no-untyped-call]

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        assert isinstance(stream, torch.cuda.Stream)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def record(self, stream: Stream) -> torch.cuda.Event:
        assert isinstance(stream, torch.cuda.Stream)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        return event


def default_device(regions: SealedRegions | None = None) -> Device:
    """CUDA where torch sees a GPU, the CPU stub (opening handles in `regions`) otherwise."""
    return CudaDevice() if torch.cuda.is_available() else CpuDevice(regions)
