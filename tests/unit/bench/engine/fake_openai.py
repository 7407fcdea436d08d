"""A fake OpenAI-compatible completion server for `bench engine` tests: real HTTP (uvicorn on a free
port, in a thread of the test process), streamed SSE tokens with small delays, a prefix cache
simulated over 16-token blocks whose counters `/metrics` exposes under vLLM's names, and an
optional fake sidecar (`/status`, `/metrics` with kvdepot's names).

Every request's prompt is recorded. Answers are a function of the prompt (`answer_ids`), so a test
can check that a chat's next prompt carries exactly the ids the server generated. With
`token_ids=False` the stream carries text only (`t<id> ...`) and `/tokenize` turns it back into ids.
With `vocab_size`, a prompt id beyond it is refused as vLLM refuses it: a 400 with vLLM's error body
for a plain request, a 200 stream holding one error event for a streamed one. Plain (not streamed)
requests, which `bench engine` sends only to learn the vocabulary, are recorded apart (`probes`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.ports import free_port

BLOCK = 16


def answer_ids(prompt: list[int], n: int) -> list[int]:
    seed = sum(prompt) * 31 + len(prompt)
    return [1000 + (seed + 7 * i) % 5000 for i in range(n)]


@dataclass
class FakeState:
    token_ids: bool = True
    token_delay_s: float = 0.002
    fail_every: int = 0
    """Answer HTTP 500 to every n-th request (0: never)."""
    vocab_size: int | None = None
    """Refuse prompts holding an id at or above it (None: any id goes)."""
    prompts: list[list[int]] = field(default_factory=list)
    probes: list[list[int]] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    blocks: set[bytes] = field(default_factory=set)
    queries: int = 0
    hits: int = 0
    sidecar_lookups: int = 0
    engine_hook: Callable[[list[int]], int] | None = None
    """Stands in for a connector: called (in a worker thread) with every prompt, returns the hit
    tokens; the counters under vLLM's names then report those hits."""

    def reset(self) -> None:
        """Every field back to its default, in place (a server built on this state serves on)."""
        for f in fields(self):
            setattr(self, f.name, f.default_factory() if f.default_factory is not MISSING else f.default)

    def lookup_and_store(self, prompt: list[int]) -> int:
        """Tokens of the prompt's leading full blocks seen before; remembers all its blocks."""
        h = b""
        hit, matching = 0, True
        for start in range(0, len(prompt) - len(prompt) % BLOCK, BLOCK):
            h = hashlib.sha256(h + json.dumps(prompt[start : start + BLOCK]).encode()).digest()
            if matching and h in self.blocks:
                hit += BLOCK
            else:
                matching = False
                self.blocks.add(h)
        self.queries += len(prompt)
        self.hits += hit
        return hit


def vllm_error(message: str, code: int = 400) -> dict[str, Any]:
    """vLLM's ErrorResponse body."""
    return {"error": {"message": message, "type": "BadRequestError", "param": None, "code": code}}


def _refusal(state: FakeState, prompt: list[int]) -> dict[str, Any] | None:
    if state.vocab_size is None or max(prompt) < state.vocab_size:
        return None
    return vllm_error(f"Token id {max(prompt)} is out of vocabulary")


async def _refused_stream(error: dict[str, Any]) -> AsyncIterator[bytes]:
    yield f"data: {json.dumps(error)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def build_app(state: FakeState) -> Starlette:
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def completions(request: Request) -> Response:
        body = await request.json()
        prompt = body["prompt"]
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            return JSONResponse({"error": "prompt must be token ids"}, status_code=400)
        refusal = _refusal(state, prompt)
        if not body.get("stream"):
            state.probes.append(prompt)
            if refusal is not None:
                return JSONResponse(refusal, status_code=400)
            return JSONResponse({"choices": [{"index": 0, "text": "t1 ", "finish_reason": "length"}]})
        state.prompts.append(prompt)
        if refusal is not None:
            return StreamingResponse(_refused_stream(refusal), media_type="text/event-stream")
        state.bodies.append(body)
        if state.fail_every and len(state.prompts) % state.fail_every == 0:
            return JSONResponse({"error": "injected failure"}, status_code=500)
        if state.engine_hook is not None:
            hit = await asyncio.to_thread(state.engine_hook, prompt)
            state.queries += len(prompt)
            state.hits += hit
        else:
            hit = state.lookup_and_store(prompt)
        out = answer_ids(prompt, int(body["max_tokens"]))
        want_ids = bool(body.get("return_token_ids")) and state.token_ids

        async def stream() -> AsyncIterator[bytes]:
            # Prefill: a little time per token not found in the cache.
            await asyncio.sleep(0.00002 * (len(prompt) - hit) + state.token_delay_s)
            for i, tok in enumerate(out):
                if i:
                    await asyncio.sleep(state.token_delay_s)
                choice: dict[str, Any] = {"index": 0, "text": f"t{tok} ", "finish_reason": None}
                if want_ids:
                    choice["token_ids"] = [tok]
                yield f"data: {json.dumps({'choices': [choice]})}\n\n".encode()
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(out)}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def tokenize(request: Request) -> Response:
        body = await request.json()
        return JSONResponse({"tokens": [int(w[1:]) for w in body["prompt"].split()]})

    async def metrics(request: Request) -> Response:
        lines = [
            "# HELP vllm:prefix_cache_queries Prefix cache queries.",
            "# TYPE vllm:prefix_cache_queries counter",
            f'vllm:prefix_cache_queries_total{{engine="0",model_name="fake-model"}} {float(state.queries)}',
            f'vllm:prefix_cache_queries_created{{engine="0",model_name="fake-model"}} {time.time()}',
            f'vllm:prefix_cache_hits_total{{engine="0",model_name="fake-model"}} {float(state.hits)}',
            f'vllm:external_prefix_cache_queries_total{{engine="0"}} {float(state.queries)}',
            f'vllm:external_prefix_cache_hits_total{{engine="0"}} {float(state.hits)}',
            f'vllm:prompt_tokens_by_source_total{{engine="0",source="local_compute"}} '
            f"{float(state.queries - state.hits)}",
            f'vllm:prompt_tokens_by_source_total{{engine="0",source="external_kv_transfer"}} '
            f"{float(state.hits)}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def sidecar_status(request: Request) -> Response:
        status = {
            "l1": {"capacity_bytes": 64 * 1024, "chunk_size": 256, "engines": [{"chunk_bytes": 4096}]},
            "l2": {"adapters": [{"name": "disk", "usage": {"capacity_bytes": 256 * 1024}}]},
        }
        return JSONResponse(status)

    async def sidecar_metrics(request: Request) -> Response:
        state.sidecar_lookups += 1
        n = state.sidecar_lookups
        lines = [
            f"kvdepot_lookups_total {float(n * 2)}",
            f"kvdepot_lookup_hit_chunks_total {float(n * 3)}",
            f"kvdepot_lookup_miss_chunks_total {float(n)}",
            f"kvdepot_l2_prefetch_loaded_chunks_total {float(n)}",
            f'kvdepot_l2_loads_total{{adapter="disk"}} {float(n * 5)}',
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/metrics", metrics),
            Route("/sidecar/status", sidecar_status),
            Route("/sidecar/metrics", sidecar_metrics),
        ]
    )


class FakeServer:
    """Runs the app with uvicorn in a thread of its own; `url` once started."""

    def __init__(self, state: FakeState) -> None:
        self.state = state
        self.port = free_port()
        config = uvicorn.Config(
            build_app(state), host="127.0.0.1", port=self.port, log_level="warning", lifespan="off",
            ws="none", access_log=False,
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
