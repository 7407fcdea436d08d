"""`kvdepot bench copies` as a user runs it: the CPU mode end to end at tiny sizes (a real sidecar
copying through a sealed memfd region, every loaded byte checked, the L1 chunk bytes those of the
seed), and the CUDA mode refusing clearly where there is no GPU. Timings are printed, never judged."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow

LAYERS, HEADS, HEAD_DIM, BLOCK, CHUNK, CHUNKS, REPS, SEED = 2, 2, 64, 16, 64, 3, 2, 7
BLOCK_BYTES = BLOCK * HEADS * HEAD_DIM * 2  # bfloat16
BPC = CHUNK // BLOCK
CHUNK_BYTES = 2 * LAYERS * BPC * BLOCK_BYTES


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVDEPOT_")}
    env.update(extra)
    return env


def _bench(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "bench", "copies", *args],
        capture_output=True, text=True, env=env, timeout=240, check=False,
    )  # fmt: skip


def _seed_digest() -> str:
    """The sha256 the saved chunks must have in L1: the seed's bytes, each chunk plane-major."""
    g = torch.Generator().manual_seed(SEED)
    known = torch.randint(0, 256, (2 * LAYERS, CHUNKS * BPC, BLOCK_BYTES), generator=g, dtype=torch.uint8)
    digest = hashlib.sha256()
    for c in range(CHUNKS):
        digest.update(known[:, c * BPC : (c + 1) * BPC].reshape(-1).numpy().tobytes())
    return digest.hexdigest()


def test_the_cpu_mode_saves_loads_and_verifies_every_byte_through_a_real_sidecar() -> None:
    done = _bench(
        "--device", "cpu", "--layers", str(LAYERS), "--kv-heads", str(HEADS), "--head-dim", str(HEAD_DIM),
        "--block-tokens", str(BLOCK), "--chunk-tokens", str(CHUNK), "--chunks", str(CHUNKS),
        "--blocks", "64", "--reps", str(REPS), "--warmup", "1", "--seed", str(SEED),
        env=_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    print({k: got[k] for k in ("save_vs_baseline", "load_vs_baseline", "save_gbps", "load_gbps")})
    assert (got["ok"], got["device"], got["sidecar_device"]) == (True, "cpu", "cpu")
    assert got["registered_planes"] == 2 * LAYERS
    assert got["chunk_bytes"] == CHUNK_BYTES
    assert got["bytes_verified"] == REPS * CHUNKS * CHUNK_BYTES
    assert [(r["stored"], r["hit_chunks"], r["loaded_equal"]) for r in got["runs"]] == [
        (CHUNKS, CHUNKS, True)
    ] * REPS
    assert got["l1_equal"] is True
    assert got["l1_sha256"] == _seed_digest()
    assert got["goal_ratio"] == 0.8
    for key in ("save_vs_baseline", "load_vs_baseline", "save_baseline_gbps", "load_baseline_gbps"):
        assert got[key] > 0


def test_the_cuda_mode_refuses_clearly_without_a_gpu() -> None:
    done = _bench("--device", "cuda", "--layers", "2", env=_env(CUDA_VISIBLE_DEVICES=""))
    assert done.returncode == 2
    assert done.stdout == ""
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("kvdepot bench copies: torch ")
    assert "--device cuda needs torch built with CUDA and a visible NVIDIA GPU" in line
    assert "--device cpu" in line


def test_the_device_check_says_when_its_python_is_missing() -> None:
    done = subprocess.run(
        ["bash", "bench/gpu_check.sh"], capture_output=True, text=True, timeout=60, check=False,
        env=_env(PYTHON="/nonexistent/python"),
    )  # fmt: skip
    assert done.returncode == 3
    assert "gpu_check: no Python at /nonexistent/python (set PYTHON=...)" in done.stderr
    assert "== environment" in done.stdout
