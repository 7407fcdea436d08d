"""Error classes -> HTTP statuses, in one place. Bodies are `{"error": {"code", "message"}}`."""

from __future__ import annotations

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app import errors as e

log = structlog.get_logger("kvdepot.http")

_STATUS: dict[type[e.KVDepotError], int] = {
    e.ConfigError: 422,
    e.InvalidInput: 422,
    e.ProtocolError: 400,
    e.Unauthorized: 401,
    e.NotFound: 404,
    e.Conflict: 409,
    e.BackendError: 502,
    e.TransferError: 503,
    e.NotRegistered: 404,
    e.LeaseExpired: 410,
}


def http_status(exc: e.KVDepotError) -> int:
    for cls in type(exc).__mro__:
        status = _STATUS.get(cls)
        if status is not None:
            return status
    return 500


def error_body(code: str, message: str) -> dict[str, dict[str, str]]:
    return {"error": {"code": code, "message": message}}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(e.KVDepotError)
    async def _kvdepot(_: Request, exc: e.KVDepotError) -> JSONResponse:
        status = http_status(exc)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return JSONResponse(error_body(exc.code, exc.message), status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
            parts.append(f"{loc}: {err.get('msg', 'invalid')}")
        return JSONResponse(error_body("invalid_input", "; ".join(parts)[:1000]), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(
            exc.status_code, "http_error"
        )
        return JSONResponse(error_body(code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("http_handler_failed")
        return JSONResponse(error_body("internal", f"{type(exc).__name__}"), status_code=500)
