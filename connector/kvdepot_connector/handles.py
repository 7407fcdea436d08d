"""Sharing an engine's KV tensors with the sidecar, so the sidecar copies them itself.

- CUDA tensors: torch's CUDA IPC fields (the same that torch.multiprocessing sends), which the
  sidecar opens on its side (gpu/device.py CudaDevice). The engine must keep the tensor alive.
- CPU tensors: only those inside a named shared-memory region (`SharedTensor`), opened by the
  sidecar's CPU device. Ordinary CPU memory cannot be shared and is copied by the connector.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import uuid
from pathlib import Path

import torch

from kvdepot_connector.protocol import TensorHandle

SHM_DIR = Path("/dev/shm")


class SharedTensor:
    """A tensor allocated in a named POSIX shared-memory region, shareable with the sidecar."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, shm_dir: Path = SHM_DIR) -> None:
        self.name = f"kvdepot-engine-{uuid.uuid4().hex[:12]}"
        self.path = shm_dir / self.name
        nbytes = max(1, int(torch.Size(shape).numel()) * torch.tensor([], dtype=dtype).element_size())
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._mm, dtype=dtype).view(shape)

    def close(self) -> None:
        del self.tensor
        with contextlib.suppress(BufferError):
            self._mm.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


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
        kind="cpu-shm", dtype=_dtype_name(tensor.dtype), shape=list(tensor.shape),
        stride=list(tensor.stride()), offset=byte_offset // esize, name=shared.name,
    )  # fmt: skip
