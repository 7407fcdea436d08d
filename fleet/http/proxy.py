"""Relaying one request to an engine, with a retry on another engine when it fails before any
byte went back to the client.

A request is sent to the decided engine; what counts as "failed before any byte": no connection,
a 5xx status, a connection cut or a read timeout before the answer's first chunk (a stream) or its
whole body (a plain JSON answer, which is read completely before it is relayed). Then the engine is
marked unhealthy, the next decision excludes it, and the same request goes to another engine
(`retries` times at most). Once a stream's first chunk went out, a failure cannot be hidden: the
stream ends with an SSE `data: {"error": ...}` event (what vLLM itself sends on an error mid-stream)
and no `[DONE]`. An engine silent for `read_timeout_s` mid-stream is such a failure.

Streams are relayed chunk by chunk as they arrive (`aiter_raw`: no decoding, no buffering).

State: none of its own; it moves the per-engine in-flight counts (fleet/router.Engines) and the
metrics. Runs on the router's event loop, per request.

Primitives in call order: Proxy(settings, client, engines, metrics); await relay(path, body,
headers, first decision, scores) -> Response.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence

import anyio
import httpx
import orjson
import structlog
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse

from fleet.http.calls import RouterCalls
from fleet.router import Decision, Engine, Score

__all__ = ["HOP_BY_HOP", "Proxy", "end_to_end", "error_response"]

log = structlog.get_logger("kvdepot.route")

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "proxy-connection", "host", "content-length", "date", "server",
})  # fmt: skip


def end_to_end(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The headers a proxy passes on: neither the hop-by-hop ones (HOP_BY_HOP: the connection's own,
    and those the relay sets itself) nor any the sender named in its `Connection` header
    (RFC 9110 §7.6.1: they were meant for this hop only)."""
    items = [(k.lower(), v) for k, v in headers]
    named = {t.strip().lower() for k, v in items if k == "connection" for t in v.split(",")}
    return {k: v for k, v in items if k not in HOP_BY_HOP and k not in named}


RETRYABLE_STATUS = frozenset({500, 502, 503, 504})


def error_response(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


class _Failed(Exception):
    """An engine failed before any byte went back; `kind` is the errors metric's label."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


class Proxy(RouterCalls):
    async def relay(
        self,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        first: Decision,
        scores: Sequence[Score] | None,
    ) -> Response:
        """Send the request to `first.engine`, to other engines on failure; the client's answer."""
        tried: list[Engine] = []
        decision: Decision | None = first
        last = "no engine"
        while decision is not None and len(tried) <= self.settings.retries:
            engine = decision.engine
            tried.append(engine)
            if len(tried) > 1:
                self.metrics.retries.inc()
                log.info("route_retry", engine=engine.shown, after=last)
            try:
                final = len(tried) > self.settings.retries
                return await self._send(path, body, headers, decision, final=final)
            except _Failed as exc:
                self.metrics.errors.labels(exc.kind).inc()
                self.engines.mark_failed(engine, str(exc))
                last = f"{engine.shown}: {exc}"
                log.warning("engine_failed", engine=engine.shown, kind=exc.kind, error=str(exc)[:300])
            decision = self.engines.choose(scores, "retry", exclude=tried)
        self.metrics.errors.labels("no_engine").inc()
        return error_response(503, "engines_unavailable", f"no engine answered; last failure: {last}"[:1000])

    async def _send(
        self, path: str, body: bytes, headers: Mapping[str, str], decision: Decision, *, final: bool
    ) -> Response:
        engine = decision.engine
        s = self.settings
        timeout = httpx.Timeout(s.read_timeout_s, connect=s.connect_timeout_s)
        request = self.client.build_request(
            "POST", engine.url + path, content=body, headers=dict(headers), timeout=timeout
        )
        self.engines.acquire(engine)
        gauge = self.metrics.in_flight.labels(engine.shown)
        gauge.inc()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.engines.release(engine)
                gauge.dec()

        start = time.perf_counter()
        streaming = False
        resp: httpx.Response | None = None
        try:
            resp = await self._open(request)
            if resp.status_code in RETRYABLE_STATUS and not final:
                raise _Failed("engine_status", f"HTTP {resp.status_code}")
            out_headers = _answer_headers(resp.headers, decision)
            chunks = resp.aiter_raw()
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                first = await self._first_chunk(chunks)
                self.metrics.upstream_first_byte.labels(engine.shown).observe(time.perf_counter() - start)
                upstream, resp, streaming = resp, None, True  # the stream releases and closes them
                return self._streaming(upstream, first, chunks, engine, release=release, headers=out_headers)
            data = await self._whole(chunks)
            self.metrics.upstream_first_byte.labels(engine.shown).observe(time.perf_counter() - start)
            return Response(data, status_code=resp.status_code, headers=out_headers)
        finally:
            if resp is not None:  # not handed to a stream: an error, or a plain answer read whole
                release()
                await resp.aclose()
            elif not streaming:
                release()

    async def _open(self, request: httpx.Request) -> httpx.Response:
        """Send the request, its answer's headers read; a failure to get them raises _Failed."""
        try:
            return await self.client.send(request, stream=True)
        except httpx.ConnectError as exc:
            raise _Failed("engine_connect", f"connect: {exc}") from None
        except httpx.TimeoutException as exc:
            raise _Failed("engine_timeout", f"timeout: {type(exc).__name__}") from None
        except httpx.TransportError as exc:
            raise _Failed("engine_broken", f"{type(exc).__name__}: {exc}") from None

    def _streaming(
        self,
        upstream: httpx.Response,
        first: bytes,
        chunks: AsyncIterator[bytes],
        engine: Engine,
        *,
        release: Callable[[], None],
        headers: dict[str, str],
    ) -> StreamingResponse:
        """The client's stream of the engine's answer: its end (or the response's, if the stream
        never starts) releases the engine and closes the answer."""

        async def close() -> None:  # idempotent: the stream's end, or after the response
            release()
            with anyio.CancelScope(shield=True):
                await upstream.aclose()

        return StreamingResponse(
            self._stream(first, chunks, engine, close), status_code=upstream.status_code, headers=headers,
            background=BackgroundTask(close),
        )  # fmt: skip

    async def _first_chunk(self, chunks: AsyncIterator[bytes]) -> bytes:
        try:
            async for chunk in chunks:
                if chunk:
                    return chunk
        except httpx.TimeoutException:
            raise _Failed("engine_timeout", "no first chunk within read_timeout_s") from None
        except httpx.TransportError as exc:
            raise _Failed("engine_broken", f"before the first chunk: {type(exc).__name__}") from None
        return b""

    async def _whole(self, chunks: AsyncIterator[bytes]) -> bytes:
        parts: list[bytes] = []
        size = 0
        try:
            async for chunk in chunks:
                size += len(chunk)
                if size > self.settings.max_response_bytes:
                    raise _Failed("engine_status", "answer larger than max_response_bytes")
                parts.append(chunk)
        except httpx.TimeoutException:
            raise _Failed("engine_timeout", "answer not complete within read_timeout_s") from None
        except httpx.TransportError as exc:
            raise _Failed("engine_broken", f"answer cut: {type(exc).__name__}") from None
        return b"".join(parts)

    async def _stream(
        self,
        first: bytes,
        chunks: AsyncIterator[bytes],
        engine: Engine,
        close: Callable[[], Awaitable[None]],
    ) -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            try:
                async for chunk in chunks:
                    yield chunk
            except (httpx.TimeoutException, httpx.TransportError) as exc:
                kind = "timeout" if isinstance(exc, httpx.TimeoutException) else type(exc).__name__
                self.metrics.errors.labels("midstream").inc()
                self.engines.mark_failed(engine, f"mid-stream: {kind}")
                log.warning("engine_failed_midstream", engine=engine.shown, error=kind)
                message = f"the engine failed mid-stream ({kind})"
                event = {"error": {"code": "engine_failed", "message": message}}
                yield b"\n\ndata: " + orjson.dumps(event) + b"\n\n"
        finally:
            await close()


def _answer_headers(upstream: httpx.Headers, decision: Decision) -> dict[str, str]:
    out = end_to_end(upstream.items())
    out["x-kvdepot-engine"] = decision.engine.shown
    out["x-kvdepot-route"] = decision.reason
    return out
