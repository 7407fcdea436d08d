"""Fakes for the router's tests, each a real HTTP server in its own process (uvicorn on a port):

- `engine`: an OpenAI-compatible engine. /tokenize (a deterministic tokenizer: a prompt's
  characters' code points, after a BOS 1 when `add_special_tokens`; a chat's `role:content|` pieces
  after a 2, and a 3 when `add_generation_prompt`), /v1/models (the base model `base` and the LoRA
  adapter `adapter-x` whose parent is `base`), /v1/completions and /v1/chat/completions, plain or
  streamed (SSE), every answer naming the engine. The request's `fake` object steers it: `gate`
  (stream: `gate_at` chunks (default 1; 0: headers only), then wait for POST /_release/{gate};
  plain: wait before answering),
  `hang_after` (stream that many chunks, then hang), `status` (answer that HTTP status), `chunks`;
  `only` (an engine's name: the others ignore `fake`).
  GET /_seen tells what it received and which gates are waiting. `--api-key`: /v1 paths need it.
- `directory`: answers POST /v1/score with what PUT /_answer set, or per PUT /_mode: `hang`,
  `error` (500), `garbage`; GET /_requests lists the score requests received.

Run: python -m tests.integration.route_fakes engine --port P --name A
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route


def fake_tokens(body: dict[str, Any]) -> list[int]:
    """The fake engine's tokenizer (tests compute the expected ids with it)."""
    if "messages" in body:
        out = [2]
        for m in body["messages"]:
            out += [ord(c) for c in f"{m['role']}:{m['content']}|"]
        if body.get("add_generation_prompt", True):
            out.append(3)
        if body.get("add_special_tokens", False):
            out.insert(0, 1)
        return out
    bos = [1] if body.get("add_special_tokens", True) else []
    return bos + [ord(c) for c in body["prompt"]]


def engine_app(name: str, api_key: str | None = None) -> Starlette:
    seen: dict[str, Any] = {"requests": 0, "tokenize": 0, "tokenize_bodies": [], "bodies": [], "headers": []}
    gates: dict[str, asyncio.Event] = {}
    waiting: set[str] = set()

    async def wait_gate(key: str) -> None:
        event = gates.setdefault(key, asyncio.Event())
        waiting.add(key)
        try:
            await event.wait()
        finally:
            waiting.discard(key)

    async def tokenize(request: Request) -> Response:
        body = await request.json()
        seen["tokenize"] += 1
        seen["tokenize_bodies"].append(body)
        tokens = fake_tokens(body)
        return JSONResponse({"count": len(tokens), "max_model_len": 8192, "tokens": tokens})

    async def complete(request: Request) -> Response:
        body = await request.json()
        seen["requests"] += 1
        seen["bodies"].append({k: v for k, v in body.items() if k != "prompt"})
        seen["headers"].append(dict(request.headers))
        fake = body.get("fake") or {}
        if fake.get("only", name) != name:
            fake = {}
        if "status" in fake:
            return JSONResponse({"error": {"message": "fake failure"}, "engine": name},
                                status_code=fake["status"])  # fmt: skip
        chunks = int(fake.get("chunks", 3))
        gate = fake.get("gate")
        if not body.get("stream"):
            if gate:
                await wait_gate(gate)
            return JSONResponse({"object": "text_completion", "engine": name,
                                 "choices": [{"index": 0, "text": " ".join(["tok"] * chunks)}]})  # fmt: skip

        async def events() -> AsyncIterator[bytes]:
            for i in range(chunks):
                if i == fake.get("hang_after"):
                    await asyncio.Event().wait()
                if i == fake.get("gate_at", 1) and gate:
                    await wait_gate(gate)
                event = {"engine": name, "choices": [{"index": 0, "text": f"tok{i}"}]}
                yield b"data: " + json.dumps(event).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "engine": name, "data": [
            {"id": "base", "object": "model", "parent": None},
            {"id": "adapter-x", "object": "model", "parent": "base"},
        ]})  # fmt: skip

    async def health(_: Request) -> Response:
        return PlainTextResponse("")

    async def seen_(_: Request) -> Response:
        return JSONResponse({**seen, "waiting": sorted(waiting)})

    async def release(request: Request) -> Response:
        gates.setdefault(request.path_params["key"], asyncio.Event()).set()
        return PlainTextResponse("released")

    async def guard(request: Request, call_next: Any) -> Response:
        # as vLLM's --api-key: every /v1 path needs the bearer token, /tokenize and /health do not
        wanted = f"Bearer {api_key}"
        if api_key and request.url.path.startswith("/v1") and request.headers.get("authorization") != wanted:
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        response: Response = await call_next(request)
        return response

    return Starlette(middleware=[Middleware(BaseHTTPMiddleware, dispatch=guard)], routes=[
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/v1/completions", complete, methods=["POST"]),
        Route("/v1/chat/completions", complete, methods=["POST"]),
        Route("/v1/models", models),
        Route("/health", health),
        Route("/_seen", seen_),
        Route("/_release/{key}", release, methods=["POST"]),
    ])  # fmt: skip


def directory_app() -> Starlette:
    state: dict[str, Any] = {"answer": {"chunk_size": 256, "instances": []}, "mode": "ok", "requests": []}

    async def score(request: Request) -> Response:
        state["requests"].append(await request.json())
        mode = state["mode"]
        if mode == "hang":
            await asyncio.Event().wait()
        if mode == "error":
            return JSONResponse({"error": "fake"}, status_code=500)
        if mode == "garbage":
            return JSONResponse({"instances": [{"id": 7}]})
        return JSONResponse(state["answer"])

    async def set_answer(request: Request) -> Response:
        state["answer"] = await request.json()
        return PlainTextResponse("ok")

    async def set_mode(request: Request) -> Response:
        state["mode"] = (await request.json())["mode"]
        return PlainTextResponse("ok")

    async def requests_(_: Request) -> Response:
        return JSONResponse(state["requests"])

    return Starlette(routes=[
        Route("/v1/score", score, methods=["POST"]),
        Route("/_answer", set_answer, methods=["PUT"]),
        Route("/_mode", set_mode, methods=["PUT"]),
        Route("/_requests", requests_),
    ])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["engine", "directory"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="engine")
    parser.add_argument("--api-key")
    args = parser.parse_args()
    app = engine_app(args.name, args.api_key) if args.kind == "engine" else directory_app()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
