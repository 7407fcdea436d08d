"""`kvdepot route` as a real process in front of fake engines and a fake directory, each a real
HTTP server in its own process: it routes to the directory's best instance, falls back to the least
loaded engine (directory down, hung, answering garbage or nothing), retries a killed engine without
failing the request, relays streams chunk by chunk, bounds an engine that hangs mid-stream, refuses
hostile input with a clear 4xx and keeps serving, and counts all of it in /metrics."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.route_fakes import fake_tokens
from tests.integration.route_helpers import Proc, engines_toml, fake_directory, fake_engine, metric, router
from tests.integration.waiting import wait_for

pytestmark = pytest.mark.slow


class Fleet:
    def __init__(
        self, tmp_path: Path, extra: str = "", engines: int = 2, api_key: str | None = None,
        directory_userinfo: str = "",
    ) -> None:  # fmt: skip
        self.engines: list[Proc] = []
        self.directory: Proc | None = None
        self.router: Proc | None = None
        try:
            self.engines = [fake_engine(chr(ord("A") + i), api_key) for i in range(engines)]
            self.directory = fake_directory()
            # deadlines far above what a loaded machine takes, yet short enough for the hang tests
            config = (
                f'directory_url = "{self._with_userinfo(self.directory.url, directory_userinfo)}"\n'
                'directory_timeout_ms = 1000\nread_timeout_s = 2\n'
                f"{extra}\n"
            )
            self.router = router(tmp_path, config + engines_toml(*self.engines))
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _with_userinfo(url: str, userinfo: str) -> str:
        return url.replace("://", f"://{userinfo}@", 1) if userinfo else url

    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.url

    def answer(self, **prefixes: int) -> None:
        """The directory's next answers: `sc_0=512` says engine 0's sidecar holds 512 tokens."""
        assert self.directory is not None
        instances = [
            {"id": name.replace("_", "-"), "url": "http://sidecar", "prefix_tokens": n,
             "tiers": {"l1": n}, "score": float(n)}
            for name, n in sorted(prefixes.items(), key=lambda kv: -kv[1])
        ]  # fmt: skip
        httpx.put(self.directory.url + "/_answer", json={"chunk_size": 256, "instances": instances})

    def mode(self, mode: str) -> None:
        assert self.directory is not None
        httpx.put(self.directory.url + "/_mode", json={"mode": mode})

    def scored(self) -> list[dict[str, Any]]:
        assert self.directory is not None
        got: list[dict[str, Any]] = self.directory.get("/_requests")
        return got

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def stop(self) -> None:
        for p in [self.router, self.directory, *self.engines]:
            if p is not None:
                p.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("route"))
    yield f
    f.stop()


def complete(url: str, body: dict[str, Any], path: str = "/v1/completions") -> httpx.Response:
    # a bound on the whole request: a router that hangs fails the test, never the suite
    return httpx.post(url + path, json={"model": "base", "max_tokens": 2, **body}, timeout=30)


def served_by(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    engine: str = resp.json()["engine"]
    assert resp.headers["x-kvdepot-engine"].startswith("http://127.0.0.1:")
    return engine


def test_routes_to_the_instance_the_directory_scores_best(fleet: Fleet) -> None:
    before = fleet.metrics()
    for best, expect in (("sc_1", "B"), ("sc_0", "A"), ("sc_1", "B")):
        fleet.answer(**{best: 512, ("sc_0" if best == "sc_1" else "sc_1"): 256})
        resp = complete(fleet.url, {"prompt": "hello world", "cache_salt": "tenant-1"})
        assert served_by(resp) == expect
        assert resp.headers["x-kvdepot-route"] == "prefix"
    # the directory was asked with the engine's own tokens, the tenant and the model
    asked = fleet.scored()[-1]
    assert asked == {"model": "base", "token_ids": fake_tokens({"prompt": "hello world"}),
                     "cache_salt": "tenant-1", "lora_name": None}  # fmt: skip
    after = fleet.metrics()
    routed = sum(
        metric(after, "kvdepot_route_routed_total", engine=e.url)
        - metric(before, "kvdepot_route_routed_total", engine=e.url)
        for e in fleet.engines
    )
    assert routed == 3


def test_tokenizes_as_the_engine_does_and_passes_lora_and_salt(fleet: Fleet) -> None:
    fleet.answer(sc_0=256)
    ids = [5, 6, 7, 8]
    tokenized_before = sum(e.get("/_seen")["tokenize"] for e in fleet.engines)
    assert served_by(complete(fleet.url, {"prompt": ids, "model": "adapter-x"})) == "A"
    assert fleet.scored()[-1] == {"model": "base", "token_ids": ids, "cache_salt": None,
                                  "lora_name": "adapter-x"}  # fmt: skip
    # token ids need no /tokenize
    assert sum(e.get("/_seen")["tokenize"] for e in fleet.engines) == tokenized_before
    # a string prompt without special tokens; a chat with its template's fields
    complete(fleet.url, {"prompt": "abc", "add_special_tokens": False})
    assert fleet.scored()[-1]["token_ids"] == [97, 98, 99]
    messages = [{"role": "user", "content": "hi"}]
    resp = complete(fleet.url, {"messages": messages, "add_generation_prompt": False, "cache_salt": "t2"},
                    path="/v1/chat/completions")  # fmt: skip
    assert served_by(resp) == "A"
    asked = fleet.scored()[-1]
    assert asked["token_ids"] == fake_tokens({"messages": messages, "add_generation_prompt": False})
    assert asked["cache_salt"] == "t2"
    # the request itself reaches the engine unchanged
    last = fleet.engines[0].get("/_seen")["bodies"][-1]
    assert last["messages"] == messages and last["cache_salt"] == "t2"
    # a streamed chat is relayed as a stream
    resp = complete(fleet.url, {"messages": messages, "stream": True}, path="/v1/chat/completions")
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["x-kvdepot-route"] == "prefix" and resp.text.rstrip().endswith("data: [DONE]")


def test_no_prefix_goes_to_the_least_loaded_engine(fleet: Fleet) -> None:
    fleet.answer(sc_0=0, sc_1=0)
    before = fleet.metrics()
    # a request held on one engine makes it the busier one
    with httpx.Client(timeout=30) as client, client.stream(
        "POST", fleet.url + "/v1/completions",
        json={"model": "base", "prompt": "x", "stream": True, "fake": {"gate": "nopfx"}},
    ) as held:  # fmt: skip
        first = held.headers["x-kvdepot-engine"]
        assert held.headers["x-kvdepot-route"] == "no_prefix"
        busy = next(e for e in fleet.engines if e.url == first)
        idle = next(e for e in fleet.engines if e.url != first)
        for _ in range(3):
            resp = complete(fleet.url, {"prompt": "y"})
            assert resp.headers["x-kvdepot-engine"] == idle.url
            assert resp.headers["x-kvdepot-route"] == "no_prefix"
        httpx.post(busy.url + "/_release/nopfx")
        assert b"[DONE]" in held.read()
    after = fleet.metrics()
    assert metric(after, "kvdepot_route_fallback_total", reason="no_prefix") - metric(
        before, "kvdepot_route_fallback_total", reason="no_prefix"
    ) == 4


@pytest.mark.parametrize(("mode", "reason"), [
    ("hang", "directory_timeout"), ("error", "directory_down"), ("garbage", "directory_down"),
])  # fmt: skip
def test_a_failing_directory_never_fails_or_hangs_a_request(fleet: Fleet, mode: str, reason: str) -> None:
    fleet.answer(sc_1=1024)
    fleet.mode(mode)
    try:
        before = fleet.metrics()
        for _ in range(2):
            resp = complete(fleet.url, {"prompt": "tell me"})
            assert resp.status_code == 200
            assert resp.headers["x-kvdepot-route"] == reason
        after = fleet.metrics()
        assert metric(after, "kvdepot_route_fallback_total", reason=reason) - metric(
            before, "kvdepot_route_fallback_total", reason=reason
        ) == 2
    finally:
        fleet.mode("ok")
    assert complete(fleet.url, {"prompt": "tell me"}).headers["x-kvdepot-route"] == "prefix"


def test_an_unknown_instance_or_an_empty_answer_is_routed_by_load(fleet: Fleet) -> None:
    fleet.answer(sc_9=4096)
    assert complete(fleet.url, {"prompt": "p"}).headers["x-kvdepot-route"] == "unknown_instance"
    fleet.answer()
    assert complete(fleet.url, {"prompt": "p"}).headers["x-kvdepot-route"] == "no_prefix"


def test_stream_chunks_arrive_before_the_engine_finishes(fleet: Fleet) -> None:
    fleet.answer(sc_1=512)
    engine = fleet.engines[1]
    body = {"model": "base", "prompt": "s", "stream": True, "fake": {"gate": "stream1", "chunks": 3}}
    with httpx.Client(timeout=30) as client, client.stream(
        "POST", fleet.url + "/v1/completions", json=body
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = resp.iter_lines()
        first = next(lines)
        # the first event is here while the engine still holds the rest of the stream
        assert first.startswith("data: ") and '"tok0"' in first
        assert engine.get("/_seen")["waiting"] == ["stream1"]
        httpx.post(engine.url + "/_release/stream1")
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert [json.loads(r.removeprefix("data: "))["choices"][0]["text"] for r in rest[:-1]] == ["tok1", "tok2"]


def test_an_engine_hanging_mid_stream_is_cut_off(fleet: Fleet) -> None:
    fleet.answer(sc_0=512)
    before = fleet.metrics()
    body = {"model": "base", "prompt": "h", "stream": True, "fake": {"hang_after": 1, "chunks": 3}}
    resp = httpx.post(fleet.url + "/v1/completions", json=body, timeout=30)  # read_timeout_s = 2
    events = [line for line in resp.text.splitlines() if line]
    assert '"tok0"' in events[0]
    assert '"engine_failed"' in events[-1] and "[DONE]" not in resp.text
    after = fleet.metrics()
    assert metric(after, "kvdepot_route_errors_total", kind="midstream") - metric(
        before, "kvdepot_route_errors_total", kind="midstream"
    ) == 1
    # the engine was marked failed; its health poll brings it back
    wait_for(lambda: complete(fleet.url, {"prompt": "h"}).headers["x-kvdepot-route"] == "prefix",
             what="engine healthy again")  # fmt: skip


def test_a_5xx_before_any_byte_is_retried_on_another_engine(fleet: Fleet) -> None:
    fleet.answer(sc_0=512)
    before = fleet.metrics()
    # both engines answer 503 to this body: the second answer is relayed as it is
    resp = complete(fleet.url, {"prompt": "r", "fake": {"status": 503}})
    assert resp.status_code == 503 and resp.json()["engine"] == "B"
    after = fleet.metrics()
    assert metric(after, "kvdepot_route_retries_total") - metric(before, "kvdepot_route_retries_total") == 1
    # a 4xx is the client's: relayed, not retried
    resp = complete(fleet.url, {"prompt": "r", "fake": {"status": 400}})
    assert resp.status_code == 400
    retries = "kvdepot_route_retries_total"
    assert metric(fleet.metrics(), retries) == metric(after, retries)
    wait_for(lambda: complete(fleet.url, {"prompt": "h"}).headers["x-kvdepot-route"] == "prefix",
             what="engine healthy again")  # fmt: skip


def test_hostile_input_gets_a_clear_4xx_and_the_router_goes_on(fleet: Fleet) -> None:
    url = fleet.url + "/v1/completions"
    for content in (b"{not json", b"[1, 2]", b'"text"', b"\xff\xfe"):
        resp = httpx.post(url, content=content, headers={"content-type": "application/json"})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "bad_json"
    big = b'{"prompt": "' + b"a" * (17 * 1024 * 1024) + b'"}'
    resp = httpx.post(url, content=big, timeout=30)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "payload_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"a" * (1024 * 1024)

    resp = httpx.post(url, content=chunked(), timeout=30)
    assert resp.status_code == 413
    assert httpx.get(fleet.url + "/v1/nothing").status_code == 404
    assert httpx.get(fleet.url + "/v1/nothing").json()["error"]["code"] == "not_found"
    assert httpx.get(url).status_code == 405
    # shapes the router cannot score are the engine's to judge: routed by load, relayed
    resp = complete(fleet.url, {"prompt": {"odd": 1}})
    assert resp.status_code == 200 and resp.headers["x-kvdepot-route"] == "bad_request"
    # more token ids than any engine takes: not checked id by id, not scored
    resp = complete(fleet.url, {"prompt": [7] * ((1 << 20) + 1)})
    assert resp.status_code == 200 and resp.headers["x-kvdepot-route"] == "too_long"
    assert complete(fleet.url, {"prompt": "still fine"}).status_code == 200
    assert metric(fleet.metrics(), "kvdepot_route_errors_total", kind="bad_json") >= 4


def test_models_health_status_and_metrics(fleet: Fleet) -> None:
    models = httpx.get(fleet.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["base", "adapter-x"]
    assert httpx.get(fleet.url + "/health").text == "OK"
    status = httpx.get(fleet.url + "/status").json()
    assert [e["url"] for e in status["engines"]] == [e.url for e in fleet.engines]
    text = fleet.metrics()
    for name in ("kvdepot_route_upstream_first_byte_seconds_count", "kvdepot_route_in_flight"):
        assert metric(text, name, engine=fleet.engines[0].url) >= 0
    assert metric(text, "kvdepot_route_upstream_first_byte_seconds_count", engine=fleet.engines[0].url) > 0
    for e in fleet.engines:  # every relayed request gave its slot back
        assert metric(text, "kvdepot_route_in_flight", engine=e.url) == 0


def test_a_killed_engine_fails_no_request(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    try:
        a, b = fleet.engines
        fleet.answer(sc_0=2048, sc_1=0)
        # held by A before their first byte (the stream after its headers went out); A is killed
        bodies = [
            {"prompt": "k", "stream": True, "fake": {"gate": "k1", "gate_at": 0, "only": "A"}},
            {"prompt": "k", "fake": {"gate": "k2", "only": "A"}},
        ]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(complete, fleet.url, body) for body in bodies]
            wait_for(lambda: len(a.get("/_seen")["waiting"]) == 2, what="A holds both requests")
            a.kill()
            answers = [f.result() for f in futures]
        for resp in answers:
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kvdepot-engine"] == b.url
        assert "B" in answers[1].json()["engine"]
        assert '"engine": "B"' in answers[0].text and "[DONE]" in answers[0].text
        # later requests for A's prefix go to B at once (A is unhealthy, then refuses connections)
        for _ in range(3):
            assert served_by(complete(fleet.url, {"prompt": "k"})) == "B"
        text = fleet.metrics()
        assert metric(text, "kvdepot_route_retries_total") >= 2
        assert metric(text, "kvdepot_route_errors_total", kind="engine_broken") >= 1
        assert metric(text, "kvdepot_route_in_flight", engine=a.url) == 0
        # the directory killed too: routed by load, still answered
        assert fleet.directory is not None
        fleet.directory.kill()
        for _ in range(2):
            resp = complete(fleet.url, {"prompt": "k"})
            assert served_by(resp) == "B" and resp.headers["x-kvdepot-route"] == "directory_down"
    finally:
        fleet.stop()


def test_bad_settings_are_refused_with_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.integration.route_helpers import REPO

    bad = tmp_path / "bad.toml"
    for text, name in (
        ('[[engines]]\nurl = "ftp://x"\n', "engines.0.url"),
        ("retries = 3\n", "engines"),
        ('directory_url = "nope"\n[[engines]]\nurl = "http://a:1"\n', "directory_url"),
        ('colour = 1\n[[engines]]\nurl = "http://a:1"\n', "colour"),
    ):
        bad.write_text(text)
        args = [sys.executable, "-m", "app.cli", "route", "--config", str(bad)]
        out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 2, out.stderr
        assert len(out.stderr.splitlines()) == 1 and name in out.stderr, out.stderr
    # a port already taken
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        args = [sys.executable, "-m", "app.cli", "route", "--engine", "http://127.0.0.1:1"]
        out = subprocess.run([*args, "--http-port", port], cwd=REPO, capture_output=True, text=True,
                             timeout=60, check=False)  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.splitlines() == [f"kvdepot: port: 127.0.0.1:{port} is already in use"]


def test_a_client_leaving_before_the_answer_frees_the_engine(fleet: Fleet) -> None:
    import socket

    fleet.answer(sc_1=512)
    engine = fleet.engines[1]
    body = json.dumps({"model": "base", "prompt": "bye", "fake": {"gate": "gone1"}}).encode()
    assert fleet.router is not None
    with socket.create_connection(("127.0.0.1", fleet.router.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        wait_for(lambda: engine.get("/_seen")["waiting"] == ["gone1"], what="the engine holds the request")
        in_flight = {e["url"]: e["in_flight"] for e in httpx.get(fleet.url + "/status").json()["engines"]}
        assert in_flight[engine.url] == 1
    # the client is gone: the router drops the engine's request and frees its slot
    wait_for(lambda: {e["url"]: e["in_flight"] for e in httpx.get(fleet.url + "/status").json()["engines"]}
             [engine.url] == 0, what="the slot freed")  # fmt: skip
    assert metric(fleet.metrics(), "kvdepot_route_errors_total", kind="client_gone") == 1
    httpx.post(engine.url + "/_release/gone1")


def test_the_bench_prints_one_json_object() -> None:
    import subprocess
    import sys

    from tests.integration.route_helpers import REPO

    args = [sys.executable, "-m", "app.cli", "bench", "route", "--rounds", "5", "--stream-rounds", "1",
            "--stream-chunks", "50", "--prompt-tokens", "64"]  # fmt: skip
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    for key in ("direct_p50_ms", "ids_p50_ms", "text_p50_ms", "score_p50_ms", "router_own_p50_ms",
                "stream_routed_vs_direct"):  # fmt: skip
        assert isinstance(result[key], float), key
    assert result["stream_events_per_s_routed"] > 0


def test_engines_behind_an_api_key(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, extra='engine_api_key = "sekrit"', api_key="sekrit")
    try:
        fleet.answer(sc_1=256)
        key = {"Authorization": "Bearer sekrit"}
        # the client's own header is relayed; the router's key serves only its own calls
        resp = httpx.post(fleet.url + "/v1/completions", json={"model": "adapter-x", "prompt": "hi"},
                          headers=key, timeout=30)  # fmt: skip
        assert resp.status_code == 200 and resp.json()["engine"] == "B"
        # /v1/models (the router's key) told it adapter-x is a LoRA adapter of `base`
        assert fleet.scored()[-1]["model"] == "base" and fleet.scored()[-1]["lora_name"] == "adapter-x"
        resp = httpx.post(fleet.url + "/v1/completions", json={"model": "base", "prompt": "hi"}, timeout=30)
        assert resp.status_code == 401
        assert httpx.get(fleet.url + "/v1/models").status_code == 401
        assert httpx.get(fleet.url + "/v1/models", headers=key).status_code == 200
        assert httpx.get(fleet.url + "/health").text == "OK"
    finally:
        fleet.stop()


def test_a_crowd_of_clients_some_leaving_midway_leaves_no_slot_behind(fleet: Fleet) -> None:
    import asyncio

    fleet.answer(sc_0=256, sc_1=128)

    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = {"model": "base", "prompt": f"crowd {i}", "stream": i % 2 == 0, "fake": {"chunks": 20}}
        if i % 3 == 0:  # leaves after the first bytes of the answer
            async with client.stream("POST", fleet.url + "/v1/completions", json=body) as resp:
                async for _ in resp.aiter_bytes():
                    return "left"
        resp = await client.post(fleet.url + "/v1/completions", json=body)
        return "ok" if resp.status_code == 200 and "tok" in resp.text else f"bad {resp.status_code}"

    async def crowd() -> list[str]:
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(120)))

    results = asyncio.run(crowd())
    assert results.count("ok") == 80 and results.count("left") == 40
    wait_for(lambda: all(e["in_flight"] == 0 for e in httpx.get(fleet.url + "/status").json()["engines"]),
             what="every slot given back")  # fmt: skip
    assert complete(fleet.url, {"prompt": "after the crowd"}).status_code == 200


def test_health_follows_the_engines_and_sigterm_stops_cleanly(tmp_path: Path) -> None:
    import signal

    engine = fake_engine("solo")
    route = router(tmp_path, f'health_interval_s = 0.2\n[[engines]]\nurl = "{engine.url}"\n')
    try:
        assert httpx.get(route.url + "/health").text == "OK"
        assert complete(route.url, {"prompt": "x"}).headers["x-kvdepot-route"] == "no_directory"
        engine.kill()
        wait_for(lambda: httpx.get(route.url + "/health").status_code == 503, what="no healthy engine")
        resp = complete(route.url, {"prompt": "x"})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "engines_unavailable"
        route.proc.send_signal(signal.SIGTERM)
        assert route.proc.wait(15) == 0
    finally:
        route.stop()
        engine.stop()


def test_an_engine_that_never_answers_is_left_after_read_timeout(fleet: Fleet) -> None:
    fleet.answer(sc_0=512)
    a, b = fleet.engines
    before = fleet.metrics()
    plain = {"prompt": "mute", "fake": {"gate": "never1", "only": "A"}}
    headers_only = {"prompt": "mute", "stream": True, "fake": {"gate": "never2", "gate_at": 0, "only": "A"}}
    for body in (plain, headers_only):
        wait_for(lambda: complete(fleet.url, {"prompt": "h"}).headers["x-kvdepot-engine"] == a.url,
                 what="A healthy, chosen again")  # fmt: skip
        resp = complete(fleet.url, body)  # A holds it past read_timeout_s (2 s): B answers
        assert resp.status_code == 200 and resp.headers["x-kvdepot-engine"] == b.url
        assert '"B"' in resp.text
    after = fleet.metrics()
    errors = "kvdepot_route_errors_total"
    assert metric(after, errors, kind="engine_timeout") - metric(before, errors, kind="engine_timeout") == 2
    for gate in ("never1", "never2"):
        httpx.post(a.url + f"/_release/{gate}")
