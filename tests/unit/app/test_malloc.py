"""app/malloc.py: the allocator thresholds are set at start, and an operator's own are kept."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from app import malloc

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


def _tune_in_child(env: dict[str, str]) -> dict[str, int]:
    code = "import json; from app import malloc; print(json.dumps(malloc.tune()))"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    result: dict[str, int] = json.loads(out.stdout)
    return result


@glibc
def test_every_threshold_is_set_on_glibc() -> None:
    assert _tune_in_child({}) == {
        "mmap_threshold": malloc.MMAP_THRESHOLD,
        "trim_threshold": malloc.TRIM_THRESHOLD,
        "top_pad": malloc.TOP_PAD,
    }


@glibc
def test_a_threshold_the_operator_set_is_left_alone() -> None:
    done = _tune_in_child({"MALLOC_TOP_PAD_": "0", "MALLOC_MMAP_THRESHOLD_": "131072"})
    assert done == {"trim_threshold": malloc.TRIM_THRESHOLD}


def test_thresholds_cover_a_long_prompt_frame() -> None:
    # 128k tokens of uint32 plus the frame's own fields must stay below the mmap threshold
    assert malloc.MMAP_THRESHOLD > 4 * 131072 * 2
    assert malloc.TRIM_THRESHOLD >= 2 * malloc.MMAP_THRESHOLD
