"""The peers `kvdepot bench route` runs the router against, each in its own process: an OpenAI
server that answers at once (/tokenize: one token per character; /v1/completions: a fixed answer,
or `stream_chunks` SSE events as fast as it can write them) and a directory whose /v1/score always
names sidecar `sc-0` as holding the request's whole prompt.

Run: python -m bench.route_peers engine|directory --port P
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

ANSWER = {"object": "text_completion", "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}


def engine_app() -> Starlette:
    async def tokenize(request: Request) -> Response:
        body = await request.json()
        tokens = [ord(c) for c in body.get("prompt", "")]
        return JSONResponse({"count": len(tokens), "max_model_len": 1 << 20, "tokens": tokens})

    async def complete(request: Request) -> Response:
        body = await request.json()
        chunks = int(body.get("stream_chunks", 0))
        if not body.get("stream"):
            return JSONResponse(ANSWER)
        event = b"data: " + json.dumps({"choices": [{"index": 0, "text": "t"}]}).encode() + b"\n\n"

        async def events() -> AsyncIterator[bytes]:
            for _ in range(chunks):
                yield event
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(_: Request) -> Response:
        return PlainTextResponse("")

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "base", "parent": None}]})

    return Starlette(routes=[
        Route("/tokenize", tokenize, methods=["POST"]), Route("/v1/completions", complete, methods=["POST"]),
        Route("/health", health), Route("/v1/models", models),
    ])  # fmt: skip


def directory_app() -> Starlette:
    async def score(request: Request) -> Response:
        n = len((await request.json())["token_ids"])
        return JSONResponse({"chunk_size": 256, "instances": [
            {"id": "sc-0", "url": "http://sidecar", "prefix_tokens": n, "tiers": {"l1": n}, "score": 1.0},
        ]})  # fmt: skip

    async def health(_: Request) -> Response:
        return PlainTextResponse("OK")

    return Starlette(routes=[Route("/v1/score", score, methods=["POST"]), Route("/health", health)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["engine", "directory"])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = engine_app() if args.kind == "engine" else directory_app()
    # SIGTERM: the router's connections in flight get 2 s, then the peer exits (never waits on them)
    uvicorn.run(
        app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False,
        timeout_graceful_shutdown=2,
    )  # fmt: skip


if __name__ == "__main__":
    main()
