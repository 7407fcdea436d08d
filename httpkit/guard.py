"""RequestGuard: the checks a request passes before any of its body is read (pure ASGI middleware).

Role: FastAPI reads and parses a body before it runs a route's dependencies, so neither the admin
token of a mutation nor the size of a body can be checked there in time. This middleware runs
first: a mutation (any method but GET, HEAD and OPTIONS) without the admin token, when one is set,
is answered 401 unread, closing the connection when a body was announced (its deadline never
starts: the rest of it is never read); a body declared (Content-Length) or found (counted as it
arrives, chunked or not) larger than `http.max_body_bytes` is answered 413 with the stable code
`payload_too_large`, unread past the cap. With `body_timeout_s` (the sidecar's, the directory's and
the router's), a body not all in within that long of the request's headers is answered 408
(`body_timeout`). Both close the connection (`connection: close`): the rest of the body is never
read (what is left of a body the app answered unread is the server's: httpkit/connections.py).
Routes keep their own token check (the sidecar's `api/http/deps.Admin`, the directory's own);
`bearer_ok` is the comparison every token check uses, `admin_ok` the check of an admin token that
may be unset.

State: none; one instance wraps the app. Runs on the event loop, per request.

Primitives: RequestGuard(app, max_body_bytes, token_ok, body_timeout_s=None, count=...);
`await guard(scope, receive, send)`; bearer_ok(authorization, token); admin_ok(token, authorization).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable

from pydantic import SecretStr
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from httpkit.errors import error_body

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
TOO_LARGE = "payload_too_large"
BODY_TIMEOUT = "body_timeout"
CLOSE = {"connection": "close"}


def bearer_ok(authorization: str | None, token: str) -> bool:
    """Whether an `Authorization` header value is `Bearer <token>` (compared in constant time)."""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        given = ""
    return hmac.compare_digest(given.strip().encode(), token.encode())


def admin_ok(token: SecretStr | None, authorization: str | None) -> bool:
    """Whether an `Authorization` header value carries the admin token (always, when none is set)."""
    return token is None or bearer_ok(authorization, token.get_secret_value())


class BodyTooLarge(HTTPException):
    """Raised from `receive` when the body passes the cap; FastAPI lets an HTTPException through
    its body parsing, the error handlers answer it (413, `payload_too_large`)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than http.max_body_bytes ({limit} bytes)")


class BodyTimeout(Exception):
    """Raised from `receive` past the body's deadline. Not an HTTPException: the app's handlers let
    it through, the guard answers it (408, and the connection closed)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"the request body did not arrive within {timeout_s} s of its headers")


def _no_count(kind: str) -> None:
    return None


class RequestGuard:
    def __init__(
        self, app: ASGIApp, max_body_bytes: int, token_ok: Callable[[str | None], bool],
        body_timeout_s: float | None = None, count: Callable[[str], None] = _no_count,
    ) -> None:  # fmt: skip
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.token_ok = token_ok
        self.body_timeout_s = body_timeout_s
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if scope["method"] not in SAFE_METHODS and not self.token_ok(headers.get("authorization")):
            message = "a valid admin bearer token is required (Authorization: Bearer <token>)"
            extra = {"www-authenticate": "Bearer"} | (CLOSE if _has_body(headers) else {})
            await _answer(send, 401, "unauthorized", message, extra)
            return
        limit = self.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _answer(send, 413, TOO_LARGE, BodyTooLarge(limit).detail, CLOSE)
            return
        exchange = _Exchange(receive, send, limit, self.body_timeout_s, self.count)
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except BodyTooLarge as exc:  # read outside FastAPI's body parsing: answer here
            if exchange.started:
                raise
            await _answer(send, 413, TOO_LARGE, exc.detail, CLOSE)
        except BodyTimeout:
            if exchange.replaced:
                return
            if exchange.started:
                self.count(BODY_TIMEOUT)
                raise
            await exchange.answer_timeout()


class _Exchange:
    """One request's body, read under the cap and the deadline, and its answer. A body past its
    deadline is answered 408 here even when the app caught the error (FastAPI answers a body it
    could not read 400): the app's own answer is dropped."""

    def __init__(
        self, receive: Receive, send: Send, limit: int, timeout_s: float | None,
        count: Callable[[str], None],
    ) -> None:  # fmt: skip
        self._receive, self._send, self.count = receive, send, count
        self.limit, self.timeout_s = limit, timeout_s
        self.deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        self.received = 0
        self.body_done = self.started = self.timed_out = self.replaced = False

    async def receive(self) -> Message:
        if self.deadline is None or self.body_done:
            message = await self._receive()
        else:
            try:
                async with asyncio.timeout_at(self.deadline):
                    message = await self._receive()
            except TimeoutError:
                self.timed_out = True
                raise BodyTimeout(self.timeout_s or 0.0) from None
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                raise BodyTooLarge(self.limit)
            self.body_done = not message.get("more_body", False)
        return message

    async def send(self, message: Message) -> None:
        """The app's answer, or ours (408) when the body's deadline passed before it started."""
        if self.timed_out and not self.started and message["type"] == "http.response.start":
            self.replaced = True
            await self.answer_timeout()
        if self.replaced:
            return
        self.started = self.started or message["type"] == "http.response.start"
        await self._send(message)

    async def answer_timeout(self) -> None:
        self.count(BODY_TIMEOUT)
        self.started = True
        await _answer(self._send, 408, BODY_TIMEOUT, str(BodyTimeout(self.timeout_s or 0.0)), CLOSE)


def _has_body(headers: Headers) -> bool:
    """Whether a request's headers announce a body (a length above 0, or chunks)."""
    return headers.get("content-length", "0").strip() not in ("", "0") or "transfer-encoding" in headers


async def _answer(
    send: Send, status: int, code: str, message: str, extra: dict[str, str] | None = None
) -> None:
    body = json.dumps(error_body(code, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
