from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import torch

from gpu.device import CpuDevice, HandleError
from gpu.transfer import TransferEngine
from kvdepot_connector.handles import SharedTensor, export_tensor


@pytest.fixture
def shared() -> Iterator[SharedTensor]:
    t = SharedTensor((4, 8, 16), torch.float16)
    t.tensor.copy_(torch.arange(4 * 8 * 16, dtype=torch.float32).view(4, 8, 16).to(torch.float16))
    yield t
    t.close()


HOLDER = "instance-a"


def device_with(shared: SharedTensor) -> CpuDevice:
    """A CPU device that received `shared` over the lifeline of HOLDER's engine instance."""
    device = CpuDevice()
    device.regions.add(HOLDER, shared.name, os.dup(shared.fd), shared.nbytes)
    return device


def test_cpu_device_opens_a_view_of_the_engines_shared_tensor(shared: SharedTensor) -> None:
    view = shared.tensor[2]
    handle = msgspec.structs.asdict(export_tensor(view, shared))
    opened = device_with(shared).open(handle, HOLDER)
    assert torch.equal(opened, view)
    opened[0, 0] = 42  # the same memory, not a copy
    assert float(shared.tensor[2, 0, 0]) == 42


@pytest.mark.parametrize(
    "change",
    [{"kind": "cuda-ipc"}, {"kind": "cpu-shm"}, {"name": "../etc/passwd"}, {"name": "no-such-region"},
     {"offset": 10**9}, {"shape": [0]}, {"dtype": "complex64"}, {"stride": [1]}],
)  # fmt: skip
def test_bad_handles_are_refused(shared: SharedTensor, change: dict[str, object]) -> None:
    handle = msgspec.structs.asdict(export_tensor(shared.tensor[1], shared)) | change
    with pytest.raises(HandleError):
        device_with(shared).open(handle, HOLDER)


def test_a_region_is_opened_for_the_instance_that_shared_it_only(shared: SharedTensor) -> None:
    handle = msgspec.structs.asdict(export_tensor(shared.tensor[1], shared))
    with pytest.raises(HandleError, match="no region named"):
        device_with(shared).open(handle, "instance-b")


def test_transfer_engine_copies_when_awaited_never_on_the_loop(shared: SharedTensor) -> None:
    device = device_with(shared)
    src = device.open(msgspec.structs.asdict(export_tensor(shared.tensor[0], shared)), HOLDER)
    dst = torch.zeros_like(src)
    with ThreadPoolExecutor(1, thread_name_prefix="test-transfer") as pool:
        engine = TransferEngine(device, pool)
        stream = device.new_stream()
        device.copy(dst, src, stream)
        assert not torch.equal(dst, src), "a queued copy runs only when its event is synchronized"
        device.record(stream).synchronize()
        assert torch.equal(dst, src)
        dst.zero_()
        asyncio.run(engine.run([(dst, src)]))
        assert torch.equal(dst, src)
        assert engine.batches == 1
        with pytest.raises(ValueError, match="different sizes"):
            asyncio.run(engine.run([(dst[:1], src)]))
