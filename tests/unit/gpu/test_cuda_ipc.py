"""CUDA IPC handles are checked field by field before torch sees them (no GPU needed): a handle
that reaches beyond its storage, names a strange layout, or carries a ref counter is refused or
stripped."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from gpu.cuda_ipc import CudaHandleError, CudaIpcFields, validate, within_allocation
from kvdepot_connector.protocol import TensorHandle

PLANE = (64, 16, 8, 128)  # blocks, block size, heads, head dim: float16 -> 2 MiB


def handle(**change: Any) -> dict[str, Any]:
    """What the connector's export_tensor sends for a contiguous float16 KV plane."""
    good = TensorHandle(
        kind="cuda-ipc", dtype="float16", shape=list(PLANE), stride=[16 * 8 * 128, 8 * 128, 128, 1], offset=0,
        device=0, ipc_handle=b"\x01" * 64, storage_bytes=2 * 64 * 16 * 8 * 128, storage_offset_bytes=0,
        ref_counter_handle=b"/torch_1234_5678_0", ref_counter_offset=17, event_handle=b"\x02" * 64,
        event_sync_required=True,
    )  # fmt: skip
    return msgspec.structs.asdict(good) | change


def test_a_handle_as_the_connector_exports_it_is_accepted() -> None:
    fields = validate(handle())
    assert fields.tensor_bytes == fields.storage_bytes == 2 * 64 * 16 * 8 * 128
    assert fields.shape == PLANE
    # The client's ref-counter file and offset are not even kept: torch never sees them.
    assert not {"ref_counter_handle", "ref_counter_offset"} & set(CudaIpcFields.__slots__)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"offset": 1}, "reaches byte"),  # one element past the storage's end
        ({"storage_bytes": 1024}, "reaches byte"),  # a storage smaller than the tensor
        ({"storage_bytes": 0}, "out of bounds"),
        ({"storage_bytes": 1 << 41}, "out of bounds"),
        ({"storage_offset_bytes": 1 << 41}, "out of bounds"),
        ({"storage_offset_bytes": -4096}, "negative"),
        ({"offset": -1}, "negative"),
        ({"device": -1}, "negative"),
        ({"device": 1000}, "out of range"),
        ({"offset": True}, "integer"),
        ({"storage_bytes": 2.5}, "integer"),
        ({"dtype": "complex64"}, "dtype"),
        ({"kind": "cpu-memfd"}, "cuda-ipc"),
        ({"shape": [64, 16, 8]}, "same length"),
        ({"shape": [64, 16, 0, 128]}, "positive"),
        ({"stride": [0, 0, 0, 0]}, "contiguous"),  # every block aliasing one
        ({"stride": [1, 64, 1024, 8192]}, "contiguous"),
        ({"stride": [16 * 8 * 128, 8 * 128, 128, -1]}, "non-negative"),
        ({"ipc_handle": b""}, "empty"),
        ({"ipc_handle": b"x" * 300}, "at most"),
        ({"event_handle": b"short"}, "event_handle"),
        ({"event_sync_required": 1}, "boolean"),
    ],
)
def test_hostile_fields_are_refused_before_torch_sees_them(change: dict[str, Any], why: str) -> None:
    with pytest.raises(CudaHandleError, match=why):
        validate(handle(**change))


def test_the_storage_size_bound_is_configurable() -> None:
    with pytest.raises(CudaHandleError, match="out of bounds"):
        validate(handle(), max_storage_bytes=1 << 20)


def test_a_storage_must_lie_inside_the_allocation_the_driver_reports() -> None:
    base, size = 0x7F0000000000, 1 << 21
    assert within_allocation(base, size, base, size)
    assert within_allocation(base + 4096, size - 4096, base, size)
    assert not within_allocation(base + 4096, size, base, size)  # overruns the end
    assert not within_allocation(base - 1, 16, base, size)  # starts before it
    assert not within_allocation(base, 16, base, 0)
