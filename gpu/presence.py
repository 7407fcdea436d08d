"""Whether this machine may have a CUDA device, asked without importing torch (which takes seconds
and a few hundred MB): the wiring builds the sidecar's own copies at start-up where one may be, and
only when an engine first shares its KV cache otherwise. No state.
"""

from __future__ import annotations

import os
from pathlib import Path


def cuda_may_be_present(dev: Path = Path("/dev")) -> bool:
    """An NVIDIA GPU device node exists and CUDA_VISIBLE_DEVICES does not hide every device. It may
    still be unusable (no driver library, wrong version): torch decides when it is imported."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return any(dev.glob("nvidia[0-9]*"))
