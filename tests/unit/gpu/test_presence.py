"""gpu/presence.py: a GPU device node says a CUDA device may be there; the control nodes alone do not."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpu.presence import cuda_may_be_present


@pytest.mark.skipif("CUDA_VISIBLE_DEVICES" in os.environ, reason="the answer depends on CUDA_VISIBLE_DEVICES")
def test_a_gpu_device_node_is_what_counts(tmp_path: Path) -> None:
    assert not cuda_may_be_present(tmp_path)
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-modeset"):
        (tmp_path / name).touch()
    assert not cuda_may_be_present(tmp_path)
    (tmp_path / "nvidia0").touch()
    assert cuda_may_be_present(tmp_path)
