"""vLLM's own request objects through the real KVDepotConnector (scheduler role) against a real
sidecar: LoRA requests, multimodal features and prompt embeddings must only ever hit chunks saved
for the same adapter files, the same images at the same places, the same embeddings.

Run by tests/e2e/test_request_keys.py with the .venv-vllm interpreter:

    python tests/e2e/request_keys_check.py SIDECAR_URL MODEL_DIR WORK_DIR

The connector is built from a real VllmConfig (EngineArgs of the tiny model) and asked as vLLM's
scheduler asks it (`get_num_new_matched_tokens`, `build_connector_meta` with the request scheduled,
`request_finished`). The worker's part of a save is done here with a plain client: the SaveSpecs the
scheduler side planned (tokens, extra keys) are stored with random bytes, so what is checked is the
keying, end to end through the sidecar. Prints "ok NAME" per check; any failure raises.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.engine.arg_utils import EngineArgs
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from kvdepot_connector.client import KVDepotClient
from kvdepot_connector.vllm.connector import KVDepotConnector
from kvdepot_connector.vllm.scheduler import ScheduledRequest

BLOCK = 128
CHUNK = 128
CHUNKS = 4


def prompt(seed: int) -> list[int]:
    """4 full chunks and one token more."""
    return [(i * 7919 + seed * 104_729) % 7000 + 100 for i in range(CHUNKS * CHUNK + 1)]


PROMPT = prompt(0)


class Harness:
    def __init__(self, url: str, model_dir: str) -> None:
        kv = KVTransferConfig(
            kv_connector="KVDepotConnector", kv_role="kv_both",
            kv_connector_module_path="kvdepot_connector.vllm",
            kv_connector_extra_config={"kvdepot_url": url, "kvdepot_chunk_size": CHUNK},
        )  # fmt: skip
        config = EngineArgs(
            model=model_dir, block_size=BLOCK, max_model_len=4096, enforce_eager=True,
            kv_transfer_config=kv, enable_lora=True, max_lora_rank=8,
        ).create_engine_config()  # fmt: skip
        self.connector = KVDepotConnector(config, KVConnectorRole.SCHEDULER, None)  # type: ignore[arg-type]
        sched = self.connector._scheduler
        assert sched is not None
        self.sched = sched
        self.writer = KVDepotClient(
            url, model=self.connector._model, layout=self.connector._layout, name="check-writer",
            instance=self.connector._instance,
        ).connect()  # fmt: skip
        self.n = 0

    def request(self, **kw: Any) -> Request:
        self.n += 1
        prompt = kw.pop("prompt", PROMPT)
        return Request(f"req-{self.n}", prompt, SamplingParams(max_tokens=1), None, **kw)

    def hit(self, req: Request) -> int:
        for _ in range(100):
            got, _async = self.connector.get_num_new_matched_tokens(req, 0)
            if got is not None:
                return got
        raise AssertionError("the lookup never settled")

    def save(self, req: Request) -> int:
        """As vLLM runs a request that missed: scheduled whole, its full chunks saved."""
        assert self.hit(req) == 0
        blocks = list(range(req.num_prompt_tokens // BLOCK + 1))
        plan = self.sched.plan_step([ScheduledRequest(req.request_id, blocks, 0, req.num_prompt_tokens)])
        stored = 0
        for spec in plan.saves:
            elements = self.connector._layout.chunk_bytes // 2
            chunks = [torch.randn(elements).to(torch.bfloat16) for _ in range(spec.num_chunks)]
            out = self.writer.store(
                spec.tokens, chunks, request_id=spec.request_id, cache_salt=spec.cache_salt,
                first_chunk=spec.first_chunk, extra_keys=spec.extra_keys,
            )  # fmt: skip
            stored += out.stored + out.existing
        self.connector.request_finished(req, [])
        return stored

    def probe(self, req: Request) -> int:
        got = self.hit(req)
        self.connector.request_finished(req, [])
        return got


def adapter(work: Path, name: str, seed: int) -> Path:
    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}')
    g = torch.Generator().manual_seed(seed)
    (d / "adapter_model.safetensors").write_bytes(torch.randn(4096, generator=g).numpy().tobytes())
    return d


def image(identifier: str, offset: int, length: int = 64) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None, modality="image", identifier=identifier, mm_position=PlaceholderRange(offset, length)
    )


def check_lora(h: Harness, work: Path) -> None:
    a, b = adapter(work, "a", 1), adapter(work, "b", 2)
    lora_a = LoRARequest("adapter-a", 1, str(a))
    lora_b = LoRARequest("adapter-b", 2, str(b))
    assert h.save(h.request(lora_request=lora_a)) == CHUNKS
    assert h.probe(h.request(lora_request=lora_b)) == 0
    assert h.probe(h.request()) == 0  # the base model
    assert h.probe(h.request(lora_request=LoRARequest("adapter-a", 1, str(a)))) == CHUNKS * CHUNK
    # Another adapter's files under A's name (and id): not A's KV.
    assert h.probe(h.request(lora_request=LoRARequest("adapter-a", 1, str(b)))) == 0
    print("ok lora: another adapter, the base model, another adapter under the same name miss; A hits")

    # A reloaded in place with other weights (same name, same path): its old KV is not served.
    shutil.copy(b / "adapter_model.safetensors", a / "adapter_model.safetensors")
    assert h.probe(h.request(lora_request=LoRARequest("adapter-a", 1, str(a)))) == 0
    print("ok lora: an adapter reloaded in place with other weights misses")

    base_saved = h.save(h.request())
    assert base_saved == CHUNKS
    assert h.probe(h.request(lora_request=lora_b)) == 0
    print("ok lora: the base model's chunks are not an adapter's")


def check_mm(h: Harness) -> None:
    p = prompt(1)  # placeholder tokens are the same whatever the image: same token ids below
    x = [image("img-x", 200)]  # chunk 1 (tokens 128..255) and chunk 2 (256..)
    assert h.save(h.request(prompt=p, mm_features=x)) == CHUNKS
    # Another image behind the same placeholder tokens: nothing of X's is served (chunk 0, before any
    # image, was saved with X's request and is the plain chunk 0: the one chunk shared).
    assert h.probe(h.request(prompt=p, mm_features=[image("img-y", 200)])) == CHUNK
    assert h.probe(h.request(prompt=p, mm_features=[image("img-x", 200)])) == CHUNKS * CHUNK
    # The same image elsewhere (offset 300: chunk 2 on): chunk 1 is plain there, not X's chunk 1.
    assert h.probe(h.request(prompt=p, mm_features=[image("img-x", 300)])) == CHUNK
    assert h.probe(h.request(prompt=p)) == CHUNK  # no image at all: only the plain chunk 0
    two = [image("img-x", 200), image("img-w", 420)]  # a second image in chunk 3
    assert h.probe(h.request(prompt=p, mm_features=two)) == 3 * CHUNK
    print("ok mm: another image, the same image elsewhere, no image share only the chunk before the image;"
          " the same image hits; a second image changes its chunk on")  # fmt: skip


def check_embeds(h: Harness) -> None:
    g = torch.Generator().manual_seed(5)
    embeds = torch.randn(CHUNKS * CHUNK + 1, 64, generator=g).to(torch.bfloat16)
    assert h.save(h.request(prompt=None, prompt_embeds=embeds)) == CHUNKS
    other = embeds.clone()
    other[2 * CHUNK + 3, 7] += 1.0  # one value in chunk 2
    assert h.probe(h.request(prompt=None, prompt_embeds=other)) == 2 * CHUNK
    assert h.probe(h.request(prompt=None, prompt_embeds=embeds.clone())) == CHUNKS * CHUNK
    # The token ids of an embeddings prompt are zeros: a prompt of zeros is not its KV.
    assert h.probe(h.request(prompt=[0] * (CHUNKS * CHUNK + 1))) == 0
    print("ok embeds: other embeddings miss from the chunk that differs; the same ones hit")


def check_uncacheable(h: Harness) -> None:
    lost = LoRARequest("adapter-gone", 9, "/nonexistent/adapter")
    req = h.request(lora_request=lost)
    assert h.hit(req) == 0
    plan = h.sched.plan_step([ScheduledRequest(req.request_id, list(range(5)), 0, req.num_prompt_tokens)])
    assert not plan.saves, "an uncacheable request must not be saved"
    h.connector.request_finished(req, [])
    req = h.request(mm_features=[image("", 200)])
    assert h.probe(req) == 0
    print("ok uncacheable: an unreadable adapter and an unidentified image are neither loaded nor saved")


def main() -> None:
    url, model_dir, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    h = Harness(url, model_dir)
    check_lora(h, work)
    check_mm(h)
    check_embeds(h)
    check_uncacheable(h)
    print("all ok")


if __name__ == "__main__":
    main()
