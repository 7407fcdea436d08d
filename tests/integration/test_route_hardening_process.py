"""`kvdepot route` as a real process against hostile clients on raw sockets: connections that
trickle their headers or their body are cut at the deadline (408), connections past the cap are
refused at once (503), headers the client names in `Connection` never reach the engine (RFC 9110
§7.6.1), `/status` needs the router's token and shows no URL's credentials, and through all of it
the router keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.raw_http import Raw
from tests.integration.route_helpers import metric
from tests.integration.test_route_process import Fleet, complete, served_by
from tests.integration.waiting import wait_for

pytestmark = pytest.mark.slow

TOKEN = "router-status-token-81f2"
LIMITS = f'header_timeout_s = 1\nbody_timeout_s = 2\nadmin_token = "{TOKEN}"\n'


def port_of(fleet: Fleet) -> int:
    assert fleet.router is not None
    return fleet.router.port


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("route-hardening"), extra=LIMITS)
    yield f
    f.stop()


def test_trickling_headers_and_bodies_are_cut_and_the_router_keeps_serving(fleet: Fleet) -> None:
    fleet.answer(sc_0=256)
    port = port_of(fleet)
    headers = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nX-Pad: "
    body = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000\r\n\r\n{\"prompt\": \"")  # fmt: skip
    slow = [Raw(port, headers) for _ in range(200)] + [Raw(port, body) for _ in range(200)]
    try:
        assert served_by(complete(fleet.url, {"prompt": "while they trickle"})) in ("A", "B")

        def all_cut() -> bool:
            return sum(r.poll(b"a") for r in slow) == len(slow)

        wait_for(all_cut, timeout=30, what="every trickling connection closed by the router")
        assert all(b" 408 " in r.got.split(b"\r\n", 1)[0] for r in slow), {r.got[:60] for r in slow}
    finally:
        for r in slow:
            r.close()
    text = fleet.metrics()
    assert metric(text, "kvdepot_route_errors_total", kind="header_timeout") >= 200
    assert metric(text, "kvdepot_route_errors_total", kind="body_timeout") >= 200
    assert served_by(complete(fleet.url, {"prompt": "after them"})) in ("A", "B")


def test_connections_past_the_cap_are_refused_at_once(tmp_path: Path) -> None:
    f = Fleet(tmp_path, extra="header_timeout_s = 600\nmax_connections = 20\n")
    try:
        port = port_of(f)
        idle = [Raw(port, b"") for _ in range(60)]
        try:
            wait_for(lambda: sum(r.poll() for r in idle) >= 40, what="the connections past the cap closed")
            refused = [r for r in idle if r.closed]
            assert all(r.got.startswith(b"HTTP/1.1 503 ") for r in refused), {r.got[:40] for r in refused}
            assert sum(not r.poll() for r in idle) == 20  # the first 20 are held, as the cap says
        finally:
            for r in idle:
                r.close()
        wait_for(lambda: complete(f.url, {"prompt": "x"}).status_code == 200, what="served again")
        assert metric(f.metrics(), "kvdepot_route_errors_total", kind="connection_limit") >= 40
    finally:
        f.stop()


def test_headers_named_in_connection_are_not_forwarded(fleet: Fleet) -> None:
    fleet.answer(sc_0=256)
    headers = {"Connection": "keep-alive, X-Hop-Secret, x-other-hop", "X-Hop-Secret": "s3cr3t",
               "X-Other-Hop": "o", "Proxy-Connection": "keep-alive", "X-Kept": "kept"}  # fmt: skip
    resp = httpx.post(fleet.url + "/v1/completions", json={"model": "base", "prompt": "hop"},
                      headers=headers, timeout=30)  # fmt: skip
    engine = fleet.engines[0] if served_by(resp) == "A" else fleet.engines[1]
    seen = engine.get("/_seen")["headers"][-1]
    assert seen.get("x-kept") == "kept"
    for name in ("x-hop-secret", "x-other-hop", "proxy-connection"):
        assert name not in seen, (name, seen)
    assert "s3cr3t" not in str(seen)


def test_status_needs_the_token_and_shows_no_credentials(tmp_path: Path) -> None:
    f = Fleet(tmp_path, extra=LIMITS, directory_userinfo="route:dir-pass-4e1a")
    try:
        assert httpx.get(f.url + "/status").status_code == 401
        wrong = httpx.get(f.url + "/status", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "unauthorized"
        ok = httpx.get(f.url + "/status", headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200
        assert ok.json()["directory_url"].startswith("http://route:***@127.0.0.1:")
        assert "dir-pass-4e1a" not in ok.text
        assert served_by(complete(f.url, {"prompt": "the directory is reached with its credentials"}))
        assert httpx.get(f.url + "/health").text == "OK" and httpx.get(f.url + "/metrics").status_code == 200
    finally:
        f.stop()
    assert f.router is not None
    logged = "\n".join(f.router.lines)
    assert "route_listening" in logged and "dir-pass-4e1a" not in logged
