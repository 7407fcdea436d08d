"""The asynchronous streaming sender of `kvdepot bench engine`, and the pacing around it.

Role: send one request as a streaming `/v1/completions` with the prompt as a list of token ids
(greedy, `ignore_eos`, exactly `max_tokens` tokens), time its first streamed token, the gaps
between later ones and its end, or why it failed (`Failure`: the HTTP status, or the `code` of an
error event in the stream, and the server's message; or the exception for a request that got no
answer); and run a pass: one coroutine per request, started under a concurrency limit and/or a
Poisson arrival rate that live outside the coroutine.

State: an `httpx.AsyncClient` per server (connection pool sized to the concurrency), the
aggregator's in-flight count. Everything runs on the benchmark's one event loop.

Answer token ids (multi-round-chat): asked with `return_token_ids` (vLLM streams each chunk's
new ids as `token_ids`); when a server does not return them, the answer's text is sent to the
server's `/tokenize` and those ids are used (`ids_source` says which happened, `tokenize` or
`return_token_ids`).

Primitives, in call order: `Server.open()`, `Server.first_model()`, `Server.metrics()`,
`Server.send(spec, t0)` -> `RequestRecord`, `run_pass(...)`, `Server.close()`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from typing import Any

import httpx

from bench.engine.stats import Aggregator, Failure, RequestRecord
from bench.engine.workloads import PassSpec, RequestSpec

MESSAGE_CHARS = 200
"""How much of a server's message (or an answer's body) a failure keeps."""


class RequestFailed(Exception):
    """A request the server answered with an error (a status, or an error event in the stream)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(str(failure))
        self.failure = failure


def server_message(body: bytes) -> str:
    """The message of an error answer: the `message` of an OpenAI-style `{"error": {...}}` (vLLM's
    ErrorResponse), an `error` or `message` or `detail` string, else the body's first bytes."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        for found in (data.get("error"), data):
            if isinstance(found, dict):
                for key in ("message", "detail"):
                    if isinstance(found.get(key), str):
                        return str(found[key])[:MESSAGE_CHARS]
            elif isinstance(found, str):
                return found[:MESSAGE_CHARS]
    return body[:MESSAGE_CHARS].decode(errors="replace")


def stream_failure(error: object) -> Failure:
    """An `{"error": ...}` event inside a 200 stream: its `code` is the status when it has one."""
    code = error.get("code") if isinstance(error, dict) else None
    status = code if isinstance(code, int) else None
    message = server_message(json.dumps({"error": error}).encode())
    return Failure("stream error" if status is None else str(status), status, message, in_stream=True)


class Server:
    """One OpenAI-compatible server (`--url` or `--baseline-url`)."""

    def __init__(
        self, name: str, url: str, *, model: str | None, timeout: float, concurrency: int,
        cache_salt: str | None = None,
    ) -> None:  # fmt: skip
        self.name = name
        self.url = url.rstrip("/")
        self.model = model or ""
        self.cache_salt = cache_salt
        self.ids_source: str | None = None
        limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
        self.client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(timeout), limits=limits)

    async def close(self) -> None:
        await self.client.aclose()

    async def first_model(self) -> str:
        if not self.model:
            resp = await self.client.get("/v1/models")
            resp.raise_for_status()
            self.model = str(resp.json()["data"][0]["id"])
        return self.model

    async def metrics(self) -> str | None:
        """The server's /metrics page, or None when it has none."""
        try:
            resp = await self.client.get("/metrics")
        except httpx.HTTPError:
            return None
        return resp.text if resp.status_code == 200 else None

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model, "prompt": spec.prompt, "max_tokens": spec.max_tokens,
            "min_tokens": spec.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        if spec.want_ids:
            body["return_token_ids"] = True
        if self.cache_salt:
            body["cache_salt"] = self.cache_salt
        return body

    async def send(self, spec: RequestSpec, t0: float) -> RequestRecord:
        """One streaming request; never raises for a failed request (the record's `failure` says
        why: the HTTP status and the server's message, or the exception)."""
        start = time.perf_counter()
        rec = RequestRecord(self.name, spec.pass_name, spec.index, spec.group, start - t0, len(spec.prompt))
        try:
            await self._stream(spec, rec, start)
            spec.ok = True
        except RequestFailed as exc:
            rec.failure = exc.failure
        except (httpx.HTTPError, RuntimeError, ValueError, KeyError, TypeError) as exc:
            rec.failure = Failure(type(exc).__name__, None, (str(exc) or repr(exc))[:MESSAGE_CHARS])
        if rec.failure is not None:
            rec.e2e_s = time.perf_counter() - start
        return rec

    async def _stream(self, spec: RequestSpec, rec: RequestRecord, start: float) -> None:
        ids: list[int] = []
        text: list[str] = []
        chunks = 0
        usage_tokens: int | None = None
        last = start
        async with self.client.stream("POST", "/v1/completions", json=self.body(spec)) as resp:
            if resp.status_code != 200:
                body = await resp.aread()
                raise RequestFailed(Failure(str(resp.status_code), resp.status_code, server_message(body)))
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                event = json.loads(line[6:])
                if "error" in event:
                    raise RequestFailed(stream_failure(event["error"]))
                if event.get("usage"):
                    usage_tokens = int(event["usage"].get("completion_tokens") or 0)
                choices = event.get("choices") or []
                new_ids = (choices[0].get("token_ids") or []) if choices else []
                new_text = (choices[0].get("text") or "") if choices else ""
                if not new_ids and not new_text:
                    continue
                if rec.ttft_s is None:
                    rec.ttft_s = now - start
                else:
                    rec.itl_s.append(now - last)
                last = now
                chunks += 1
                ids.extend(int(t) for t in new_ids)
                text.append(new_text)
        if rec.ttft_s is None:
            raise RequestFailed(Failure("empty stream", None, "the stream ended without a token"))
        rec.e2e_s = time.perf_counter() - start
        rec.output_tokens = usage_tokens if usage_tokens is not None else (len(ids) or chunks)
        if spec.want_ids:
            spec.output_ids = ids or await self._tokenize("".join(text))
            self.ids_source = self.ids_source or ("return_token_ids" if ids else "tokenize")

    async def _tokenize(self, text: str) -> list[int]:
        resp = await self.client.post(
            "/tokenize", json={"model": self.model, "prompt": text, "add_special_tokens": False}
        )
        resp.raise_for_status()
        return [int(t) for t in resp.json()["tokens"]]


async def run_pass(
    server: Server,
    spec: PassSpec,
    agg: Aggregator,
    *,
    t0: float,
    concurrency: int,
    qps: float | None,
    rng: random.Random,
    deadline: float | None,
    should_stop: Callable[[], bool] = lambda: False,
) -> float:
    """Send the pass's requests, each in its own task, at most `concurrency` at a time and (with
    `qps`) at Poisson arrival times; stop issuing at `deadline` (perf_counter). Returns the wall
    seconds from the first send to the last answer."""
    sem = asyncio.Semaphore(concurrency)
    tasks: set[asyncio.Task[None]] = set()
    start = time.perf_counter()
    next_at = start

    async def one(req: RequestSpec) -> None:
        try:
            agg.add(await server.send(req, t0))
        finally:
            sem.release()

    for req in spec.requests:
        if should_stop() or (deadline is not None and time.perf_counter() >= deadline):
            break
        if qps:
            next_at += rng.expovariate(qps)
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        await sem.acquire()
        agg.started()
        task = asyncio.create_task(one(req))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)
    return time.perf_counter() - start
