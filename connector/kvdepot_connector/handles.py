"""Sharing an engine's KV tensors with the sidecar, so the sidecar copies them itself.

- CUDA tensors: torch's CUDA IPC fields (the same that torch.multiprocessing sends), which the
  sidecar opens on its side (gpu/device.py CudaDevice). The engine must keep the tensor alive.
- CPU tensors: only those inside a sealed memfd region (`SharedTensor`): its size is sealed (it
  can be neither shrunk nor grown, by anyone), and its descriptor goes to the sidecar over the
  process's lifeline (`LifelineClient.share(shared.region())`); the sidecar maps it itself and
  opens handles of kind "cpu-memfd" that name it. Ordinary CPU memory cannot be shared and is
  copied by the connector.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import uuid

import torch

from kvdepot_connector.protocol import TensorHandle

F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
SEALS = (
    getattr(fcntl, "F_SEAL_SHRINK", 2) | getattr(fcntl, "F_SEAL_GROW", 4) | getattr(fcntl, "F_SEAL_SEAL", 1)
)


class SharedTensor:
    """A tensor allocated in a sealed memfd region, shareable with the sidecar over a lifeline."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.name = f"kvdepot-engine-{uuid.uuid4().hex}"
        self.nbytes = max(1, int(torch.Size(shape).numel()) * torch.tensor([], dtype=dtype).element_size())
        self.fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.nbytes)
            fcntl.fcntl(self.fd, F_ADD_SEALS, SEALS)
            self._mm = mmap.mmap(
                self.fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        except BaseException:
            os.close(self.fd)
            raise
        self.tensor = torch.frombuffer(self._mm, dtype=dtype).view(shape)

    def region(self) -> tuple[str, int, int]:
        """(name, fd, bytes): what `LifelineClient.share` sends."""
        return self.name, self.fd, self.nbytes

    def close(self) -> None:
        del self.tensor
        with contextlib.suppress(BufferError):
            self._mm.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def export_tensor(tensor: torch.Tensor, shared: SharedTensor | None = None) -> TensorHandle:
    """The handle of `tensor` (a CUDA tensor, or a view into `shared`)."""
    if tensor.is_cuda:
        storage = tensor.untyped_storage()
        (device, ipc, storage_bytes, storage_offset, ref_handle, ref_offset, event, event_sync) = (
            storage._share_cuda_()  # type: ignore[no-untyped-call]
        )
        return TensorHandle(
            kind="cuda-ipc", dtype=_dtype_name(tensor.dtype), shape=list(tensor.shape),
            stride=list(tensor.stride()), offset=int(tensor.storage_offset()), device=int(device),
            ipc_handle=bytes(ipc), storage_bytes=int(storage_bytes), storage_offset_bytes=int(storage_offset),
            ref_counter_handle=bytes(ref_handle), ref_counter_offset=int(ref_offset),
            event_handle=bytes(event or b""), event_sync_required=bool(event_sync),
        )  # fmt: skip
    if shared is None:
        raise ValueError("a CPU tensor can be shared only from a SharedTensor region")
    base = shared.tensor
    esize = tensor.element_size()
    byte_offset = tensor.data_ptr() - base.data_ptr()
    if byte_offset < 0 or byte_offset % esize:
        raise ValueError("the tensor does not lie inside the shared region")
    return TensorHandle(
        kind="cpu-memfd", dtype=_dtype_name(tensor.dtype), shape=list(tensor.shape),
        stride=list(tensor.stride()), offset=byte_offset // esize, name=shared.name,
    )  # fmt: skip
