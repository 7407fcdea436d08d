"""The plain baselines of `bench l2` on real files, tiny sizes: they give back the bytes they
stored, say so only when it is true, and leave nothing behind. (Their timings are not judged.)"""

from __future__ import annotations

import os
from pathlib import Path

from app.bench.l2_baselines import DiskBaseline, MemoryBaseline

CHUNKS = [os.urandom(4096 + 512 * i) for i in range(5)]


def test_disk_baseline_reads_back_what_it_wrote_warm_and_cold(tmp_path: Path) -> None:
    baseline = DiskBaseline(tmp_path / "b", CHUNKS, threads=3)
    try:
        assert baseline.cold
        assert baseline.store() > 0
        assert sorted(p.stat().st_size for p in (tmp_path / "b").iterdir()) == sorted(len(c) for c in CHUNKS)
        assert baseline.load_warm() > 0
        baseline.drop()
        assert baseline.load_cold() > 0
        assert baseline.ok
    finally:
        baseline.close()
    assert list((tmp_path / "b").iterdir()) == []


def test_disk_baseline_notices_bytes_that_changed_on_disk(tmp_path: Path) -> None:
    baseline = DiskBaseline(tmp_path / "b", CHUNKS, threads=2)
    try:
        baseline.store()
        path = tmp_path / "b" / "baseline-3"
        data = bytearray(path.read_bytes())
        data[100] ^= 1
        path.write_bytes(data)
        baseline.load_warm()
        assert not baseline.ok
    finally:
        baseline.close()


def test_memory_baseline_copies_every_chunk() -> None:
    baseline = MemoryBaseline(CHUNKS)
    try:
        assert not baseline.cold
        baseline.store()
        baseline.load_warm()
        assert baseline.ok
    finally:
        baseline.close()
