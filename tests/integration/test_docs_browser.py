"""`/docs` of a real sidecar in a real headless browser (Debian's chromium; tests/run.sh installs
it), driven over the DevTools protocol (tests/integration/cdp.py): the page renders the operations
list (an opblock per route, /health among them) and every request the page made went to the
sidecar (the page's own requests, as the browser reports them). Anything bound beyond loopback
goes to a proxy of the test's own that refuses it, so nothing leaves either way. The control:
FastAPI's default docs page (assets from a CDN) in the same browser stays blank, and its CDN
requests are seen, by the page's request list and by the proxy. /redoc likewise.

A screenshot of the rendered /docs is written to $KVDEPOT_DOCS_SCREENSHOT
(default /tmp/kvdepot-docs.png)."""

from __future__ import annotations

import base64
import os
import re
import socketserver
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from fastapi.openapi.docs import get_swagger_ui_html

from tests.integration.cdp import Browser
from tests.integration.conftest import StartSidecar
from tests.integration.tools import need_tool


class Refusing(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        line = self.rfile.readline(4096).decode("latin-1").strip()
        self.server.seen.append(line)  # type: ignore[attr-defined]
        self.wfile.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")


class RecordingProxy(socketserver.ThreadingTCPServer):
    """An HTTP proxy on loopback that refuses every request and keeps its first line
    (`CONNECT host:443 HTTP/1.1`, `GET http://host/... HTTP/1.1`)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Refusing)
        self.seen: list[str] = []
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


@pytest.fixture
def proxy() -> Iterator[RecordingProxy]:
    p = RecordingProxy()
    yield p
    p.close()


@pytest.fixture
def chromium() -> str:
    return need_tool("chromium", "chromium")


OPERATIONS = "[...document.querySelectorAll('.opblock-summary-path')].map(e => e.dataset.path)"
SCREENSHOT = Path(os.environ.get("KVDEPOT_DOCS_SCREENSHOT", "/tmp/kvdepot-docs.png"))


def beyond(requests: list[str], origin: str) -> list[str]:
    """The requests that went anywhere but `origin` (inline data and blobs stay in the page)."""
    return [url for url in requests if not url.startswith((origin + "/", "data:", "blob:"))]


def test_docs_render_the_operations_with_nothing_fetched_beyond_loopback(
    sidecar_factory: StartSidecar, chromium: str, proxy: RecordingProxy, tmp_path: Path
) -> None:
    sc = sidecar_factory(l1_size_gb=0.01)
    with urllib.request.urlopen(sc.http + "/docs", timeout=10) as resp:
        html = resp.read().decode()
    resources = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert resources and all(r.startswith("/docs-assets/") for r in resources), resources
    with Browser(chromium, tmp_path / "profile", proxy.url) as browser:
        tab = browser.open(sc.http + "/docs")
        paths = tab.wait_for(f"{OPERATIONS}.length && {OPERATIONS}")
        assert paths and {"/health", "/ready", "/metrics", "/status"} <= set(paths), paths
        assert tab.evaluate("document.querySelectorAll('.opblock.opblock-get').length") >= 5
        shot = browser.call("Page.captureScreenshot", tab.session, format="png")["data"]
        SCREENSHOT.write_bytes(base64.b64decode(shot))
        requests = tab.requests
        assert sc.http + "/docs-assets/swagger-ui-bundle.js" in requests
        assert sc.http + "/openapi.json" in requests
        assert beyond(requests, sc.http) == [], requests
        # ReDoc too: the sidecar's own copy, and no fonts from anywhere.
        redoc = browser.open(sc.http + "/redoc")
        assert redoc.wait_for("document.body.innerText.includes('Liveness: OK while the process lives')")
        assert sc.http + "/docs-assets/redoc.standalone.js" in redoc.requests
        # The attribution's logo is rendered after the page: wait for it, loaded from inline data.
        logo = "document.querySelector('img[alt=\"redocly logo\"]')"
        assert redoc.wait_for(f"{logo} && {logo}.complete && {logo}.src.startsWith('data:')"), redoc.requests
        assert beyond(redoc.requests, sc.http) == [], redoc.requests


def test_the_control_fastapis_cdn_page_stays_blank_and_its_cdn_requests_are_seen(
    sidecar_factory: StartSidecar, chromium: str, proxy: RecordingProxy, tmp_path: Path
) -> None:
    sc = sidecar_factory(l1_size_gb=0.01)
    body = get_swagger_ui_html(openapi_url=sc.http + "/openapi.json", title="cdn").body

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    origin = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with Browser(chromium, tmp_path / "profile", proxy.url) as browser:
            tab = browser.open(origin + "/")
            assert not tab.wait_for(f"{OPERATIONS}.length", timeout=5)
            cdn = beyond(tab.requests, origin)
    finally:
        server.shutdown()
        server.server_close()
    assert any(url.startswith("https://cdn.jsdelivr.net/") for url in cdn), cdn
    assert any("cdn.jsdelivr.net" in line for line in proxy.seen), proxy.seen
