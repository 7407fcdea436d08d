"""The HTTP servers of a real `kvdepot serve` and a real `kvdepot directory` against hostile clients
on raw sockets, as the router is (test_route_hardening_process.py): connections that trickle their
headers (a byte per round), their body, or the body of a request already answered (a mutation
refused 401 before its body is read, a GET that declared a body) are all closed within a deadline
derived from `http.header_timeout_s` and `http.body_timeout_s`; connections past
`http.max_connections` are refused at once (503); and `/health` answers throughout."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.integration.conftest import StartSidecar
from tests.integration.directory_helpers import DirectoryProcess
from tests.integration.raw_http import Raw, trickle_until_closed
from tests.integration.waiting import wait_for

pytestmark = pytest.mark.slow

TOKEN = "budget-admin-token-5b1c"
HEADER_S, BODY_S = 1, 2
#: every trickler is cut within one deadline (headers, or headers then body), with room to spare
CUT_WITHIN_S = 10 * (HEADER_S + BODY_S)
EACH = 100  # connections per kind: 400 in all


def health_ok(base: str) -> None:
    with urllib.request.urlopen(base + "/health", timeout=5) as resp:
        assert resp.status == 200


def tricklers(port: int, mutation: bytes, token: str | None) -> dict[str, list[Raw]]:
    """Four kinds of slow client: headers never finished; a mutation's body (with the token: read
    by the app) never finished; the same without the token (answered 401 unread); a GET that
    declared a body it never finishes (answered, the body left to arrive)."""
    auth = b"" if token is None else f"Authorization: Bearer {token}\r\n".encode()
    head = b"Host: s\r\nContent-Type: application/json\r\nContent-Length: 60000\r\n"
    post = mutation + b" HTTP/1.1\r\n" + head
    return {
        "headers": [Raw(port, b"GET /health HTTP/1.1\r\nHost: s\r\nX-Pad: ") for _ in range(EACH)],
        "body": [Raw(port, post + auth + b'\r\n{"type": "') for _ in range(EACH)],
        "unread": [Raw(port, post + b'\r\n{"type": "') for _ in range(EACH)],
        "answered": [Raw(port, b"GET /health HTTP/1.1\r\n" + head + b"\r\n{") for _ in range(EACH)],
    }


def attack(base: str, mutation: bytes, token: str | None) -> dict[str, set[bytes]]:
    """Open the tricklers, trickle until the server closed them all (`/health` asked each round);
    the status codes each kind got."""
    port = urlparse(base).port
    assert port is not None
    kinds = tricklers(port, mutation, token)
    every = [r for conns in kinds.values() for r in conns]
    try:
        health_ok(base)
        try:
            trickle_until_closed(every, CUT_WITHIN_S, "all closed", meanwhile=lambda: health_ok(base))
        except AssertionError as exc:
            still = {kind: sum(not r.closed for r in conns) for kind, conns in kinds.items()}
            raise AssertionError(f"{exc}; still open per kind: {still}") from None
        return {kind: {r.status() for r in conns} for kind, conns in kinds.items()}
    finally:
        for r in every:
            r.close()


def sidecar_env(**extra: str) -> dict[str, str]:
    env = {
        "KVDEPOT_HTTP__ADMIN_TOKEN": TOKEN,
        "KVDEPOT_HTTP__HEADER_TIMEOUT_S": str(HEADER_S),
        "KVDEPOT_HTTP__BODY_TIMEOUT_S": str(BODY_S),
    }
    env.update(extra)
    return env


def test_sidecar_cuts_trickling_connections_and_keeps_answering_health(
    sidecar_factory: StartSidecar,
) -> None:
    sc = sidecar_factory(env=sidecar_env())
    got = attack(sc.http, b"POST /l2/adapters", TOKEN)
    assert got == {"headers": {b"408"}, "body": {b"408"}, "unread": {b"401"}, "answered": {b"200"}}
    health_ok(sc.http)


def test_sidecar_refuses_connections_past_the_cap(sidecar_factory: StartSidecar) -> None:
    env = sidecar_env(KVDEPOT_HTTP__HEADER_TIMEOUT_S="600", KVDEPOT_HTTP__MAX_CONNECTIONS="20")
    sc = sidecar_factory(env=env)
    port = urlparse(sc.http).port
    assert port is not None
    assert_capped(port, sc.http, 20)


def assert_capped(port: int, base: str, cap: int) -> None:
    """Three times `cap` idle connections: all but `cap` refused 503 at once, the rest held; once
    they are gone the server answers again."""
    idle = [Raw(port, b"") for _ in range(3 * cap)]
    try:
        wait_for(lambda: sum(r.poll() for r in idle) >= 2 * cap, what="the connections past the cap closed")
        refused = [r for r in idle if r.closed]
        assert {r.status() for r in refused} == {b"503"}
        assert sum(not r.poll() for r in idle) == cap  # the first `cap` are held, as the cap says
    finally:
        for r in idle:
            r.close()

    def answers() -> bool:
        try:
            health_ok(base)
        except OSError:
            return False
        return True

    wait_for(answers, what="served again once the idle connections closed")


def start_directory(tmp_path: Path, extra: str = "", header_s: int = HEADER_S) -> DirectoryProcess:
    config = tmp_path / "directory.toml"
    config.write_text(
        f'[http]\nadmin_token = "{TOKEN}"\nheader_timeout_s = {header_s}\nbody_timeout_s = {BODY_S}\n'
        + extra
    )
    return DirectoryProcess(config)


def test_directory_cuts_trickling_connections_and_keeps_answering_health(tmp_path: Path) -> None:
    d = start_directory(tmp_path)
    try:
        got = attack(d.http, b"POST /v1/score", None)
        assert got == {"headers": {b"408"}, "body": {b"408"}, "unread": {b"408"}, "answered": {b"200"}}
        got = attack(d.http, b"POST /v1/instances", TOKEN)
        assert got["headers"] == {b"408"} and got["body"] == {b"408"}, got
        health_ok(d.http)
    finally:
        d.stop()


def test_directory_refuses_connections_past_the_cap(tmp_path: Path) -> None:
    d = start_directory(tmp_path, "max_connections = 20\n", header_s=600)
    try:
        assert_capped(d.port, d.http, 20)
    finally:
        d.stop()
