"""vLLM's own v1 Scheduler and real Request objects driving KVDepotConnector (both sides) against
a real sidecar: the decode-save contract as vLLM applies it (tests/e2e/drive_scheduler.py runs the
engine loop in the vLLM environment, without a model; chunks of 32 tokens, blocks of 16).

- A finished request's blocks are held (request_finished returned True) for exactly one more
  step, one with nothing scheduled: the worker saves and reports the request finished_sending in
  that step, vLLM frees the blocks, and the engine goes idle with every block free again.
- The next turn hits through the answer's full chunk and its KV is the KV written for it.
- An aborted request is not held and its blocks come back at once.
- A request preempted by vLLM (reset_prefix_cache with running requests) looks up again when it
  resumes, loads without a failed block, and is saved and freed when it finishes.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench.sidecar import SidecarProcess, start_sidecar
from tests.e2e.harness import REPO, VLLM_PYTHON

CHUNK = 32


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Any:
    sc = start_sidecar(
        tmp_path_factory.mktemp("sidecar"), env={"KVDEPOT_L1__CHUNK_SIZE": str(CHUNK)}, l1_size_gb=0.1
    )
    yield sc
    sc.stop()


def drive(model_dir: Path, sc: SidecarProcess, scenario: str) -> dict[str, Any]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    done = subprocess.run(
        [str(VLLM_PYTHON), str(REPO / "tests/e2e/drive_scheduler.py"), str(model_dir), sc.url, scenario],
        capture_output=True, text=True, env=env, timeout=240, check=False,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


def decode_chunks(sc: SidecarProcess) -> int:
    import re
    import urllib.request

    with urllib.request.urlopen(sc.http + "/metrics", timeout=5) as answer:
        found = re.search(r"^kvdepot_decode_chunks_stored_total (\S+)$", answer.read().decode(), re.MULTILINE)
    assert found
    return int(float(found.group(1)))


def held_then_sent(rid: str) -> list[dict[str, Any]]:
    """The steps of a request whose decode save is due, from its finishing step on."""
    return [
        {"finished_req_ids": [], "finished_sending": [], "held": [rid]},
        {"scheduled": {}, "finished_req_ids": [rid], "finished_sending": [rid], "held": []},
    ]


def without_scheduled(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in s.items() if k != "scheduled" or not v} for s in steps]


def test_chat_abort_and_freeing_with_vllms_scheduler(model_dir: Path, sidecar: SidecarProcess) -> None:
    before = decode_chunks(sidecar)
    got = drive(model_dir, sidecar, "chat")
    # Turn 1: 100 prompt tokens + 40 answer tokens, 139 with KV: chunk 3 (tokens 96..127) is decode.
    assert got["turn1_output"] == 40
    assert without_scheduled(got["turn1_steps"])[-2:] == held_then_sent("t1")
    assert got["free_blocks_back"]
    assert got["turn2_hit"] == 4 * CHUNK
    assert got["turn2_kv_ok"]
    # Turn 2 (160 + 8 tokens) fills no chunk past what it loaded and its prompt saved: not held.
    assert all(not s["held"] and not s["finished_sending"] for s in got["turn2_steps"])
    # The abort: not held, nothing reported, every block free at the end.
    assert got["abort_output"] > 0
    assert got["abort_held_after_finish"] == []
    assert all(not s["held"] and not s["finished_sending"] for s in got["abort_steps"])
    assert got["free_blocks_back_at_end"]
    assert got["invalid_blocks"] == 0
    assert decode_chunks(sidecar) - before == 1


def test_a_request_preempted_by_vllm(model_dir: Path, sidecar: SidecarProcess) -> None:
    before = decode_chunks(sidecar)
    got = drive(model_dir, sidecar, "preempt")
    assert got["preemptions"] == 1
    assert got["hit_before"] == got["resumed_hit"] == 2 * CHUNK
    assert got["invalid_blocks"] == 0, "the resumed request's load must not fail"
    assert got["resumed_kv_ok"]
    assert got["output"] == 60
    assert without_scheduled(got["steps"])[-2:] == held_then_sent("r")
    assert got["free_blocks_back"]
    # 74 prompt tokens + 60 answer tokens, 133 with KV: chunks 2 and 3 hold generated tokens.
    assert decode_chunks(sidecar) - before == 2
