"""LoRA, multimodal and prompt-embeds requests as vLLM's scheduler builds them (its own `Request`,
`LoRARequest`, `MultiModalFeatureSpec` objects) through the real connector against a real sidecar:
each request only ever hits chunks saved under the same adapter files, images and embeddings; what
cannot be keyed is neither loaded nor saved, and the sidecar counts why (request_keys_check.py)."""

from __future__ import annotations

import subprocess
import urllib.request
from pathlib import Path

from bench.sidecar import start_sidecar
from tests.e2e.harness import REPO, VLLM_PYTHON


def test_vllm_requests_hit_only_their_own_adapter_images_and_embeddings(
    model_dir: Path, tmp_path: Path
) -> None:
    env = {"KVDEPOT_L1__CHUNK_SIZE": "128", "KVDEPOT_L2__ADAPTERS": "[]"}
    sidecar = start_sidecar(tmp_path / "sidecar", env=env, l1_size_gb=0.2)
    try:
        run = subprocess.run(
            [str(VLLM_PYTHON), str(REPO / "tests" / "e2e" / "request_keys_check.py"), sidecar.url,
             str(model_dir), str(tmp_path / "work")],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
        checks = [line for line in run.stdout.splitlines() if line.startswith("ok ")]
        assert len(checks) == 6 and "all ok" in run.stdout, run.stdout
        with urllib.request.urlopen(sidecar.http + "/metrics") as r:
            metrics = r.read().decode()
        for reason in ("lora_unfingerprinted", "mm_unidentified"):
            assert f'kvdepot_uncacheable_requests_total{{reason="{reason}"}} 1.0' in metrics
    finally:
        sidecar.stop()
