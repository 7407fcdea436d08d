"""The API documentation pages, served with no request leaving the sidecar's host.

FastAPI's own `/docs` and `/redoc` pages load Swagger UI, ReDoc, a favicon and fonts from public
CDNs: on an air-gapped cluster they stay blank. Here the same pages (FastAPI's
`get_swagger_ui_html` / `get_redoc_html`) point at assets the sidecar serves itself from
`ASSETS_URL`: Swagger UI 5 and ReDoc 2 as the packaged dependency `fastapi-offline` ships them
(its files only; the application stays a plain FastAPI). One request the ReDoc bundle would still
send beyond the host is closed: its "API docs by Redocly" logo (an image from redoc.ly's CDN,
rendered just after the page) is an inline empty image in the copy served here.

State: the patched ReDoc bundle (about 1 MB), read once, when the first app installs the docs.
Runs on the event loop, per request (static files through Starlette's StaticFiles).

Primitives: install_docs(app) once, on an app created with docs_url=None and redoc_url=None.
"""

from __future__ import annotations

import functools
from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

DOCS_URL = "/docs"
REDOC_URL = "/redoc"
OAUTH2_REDIRECT_URL = "/docs/oauth2-redirect"
ASSETS_URL = "/docs-assets"
ASSETS_DIR = Path(fastapi_offline.__file__).resolve().parent / "static"
REDOC_JS = "redoc.standalone.js"
REDOC_LOGO = b"https://cdn.redoc.ly/redoc/logo-mini.svg"
INLINE_LOGO = b"data:image/svg+xml,%3Csvg xmlns='http://www.w3.org/2000/svg'/%3E"


@functools.cache
def redoc_bundle() -> bytes:
    """ReDoc's bundle with its attribution logo inline instead of on redoc.ly's CDN."""
    return (ASSETS_DIR / REDOC_JS).read_bytes().replace(REDOC_LOGO, INLINE_LOGO)


def install_docs(app: FastAPI) -> None:
    """Mount the assets and add `/docs`, its OAuth2 redirect page and `/redoc` (none of them in the
    OpenAPI schema)."""
    bundle = redoc_bundle()

    @app.get(f"{ASSETS_URL}/{REDOC_JS}", include_in_schema=False)
    async def redoc_js() -> Response:  # ahead of the mount, which would serve the file unpatched
        return Response(bundle, media_type="text/javascript", headers={"cache-control": "max-age=3600"})

    app.mount(ASSETS_URL, StaticFiles(directory=ASSETS_DIR), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get(DOCS_URL, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{openapi_url}",
            title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=f"{root}{OAUTH2_REDIRECT_URL}",
            swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
        )

    @app.get(OAUTH2_REDIRECT_URL, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get(REDOC_URL, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=f"{root}{openapi_url}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{ASSETS_URL}/{REDOC_JS}",
            redoc_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            with_google_fonts=False,
        )
