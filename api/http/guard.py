"""RequestGuard: the checks a request passes before any of its body is read (pure ASGI middleware).

Role: FastAPI reads and parses a body before it runs a route's dependencies, so neither the admin
token of a mutation nor the size of a body can be checked there in time. This middleware runs
first: a mutation (any method but GET, HEAD and OPTIONS) without the admin token, when one is set,
is answered 401 unread; a body declared (Content-Length) or found (counted as it arrives, chunked
or not) larger than `http.max_body_bytes` is answered 413 with the stable code
`payload_too_large`, unread past the cap. With `body_timeout_s` (the router's), a body not all in
within that long of the request's headers is answered 408 (`body_timeout`). Both close the
connection (`connection: close`): the rest of the body is never read. Routes keep their own token
check (`deps.Admin`); `bearer_ok` is the comparison every token check uses.

State: none; one instance wraps the app. Runs on the event loop, per request.

Primitives: RequestGuard(app, max_body_bytes, token_ok, body_timeout_s=None, count=...);
`await guard(scope, receive, send)`; bearer_ok(authorization, token).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.http.errors import error_body

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
            await _answer(send, 401, "unauthorized", message, {"www-authenticate": "Bearer"})
            return
        limit = self.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _answer(send, 413, TOO_LARGE, BodyTooLarge(limit).detail, CLOSE)
            return
        received = 0
        timeout_s = self.body_timeout_s
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        body_done = False

        async def capped() -> Message:
            nonlocal received, body_done
            if deadline is None or body_done:
                message = await receive()
            else:
                try:
                    async with asyncio.timeout_at(deadline):
                        message = await receive()
                except TimeoutError:
                    raise BodyTimeout(timeout_s or 0.0) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
                body_done = not message.get("more_body", False)
            return message

        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, capped, watched)
        except BodyTooLarge as exc:  # read outside FastAPI's body parsing: answer here
            if started:
                raise
            await _answer(send, 413, TOO_LARGE, exc.detail, CLOSE)
        except BodyTimeout as exc:
            self.count(BODY_TIMEOUT)
            if started:
                raise
            await _answer(send, 408, BODY_TIMEOUT, str(exc), CLOSE)


async def _answer(
    send: Send, status: int, code: str, message: str, extra: dict[str, str] | None = None
) -> None:
    body = json.dumps(error_body(code, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
