"""A real directory against registrants that are not the sidecars they claim to be: the sidecars'
admin token (`directory.sidecar_token`) goes only to statically configured URLs, a registered one
is sent its own credential; a credential registers only its own id, and a live instance's
endpoints change only under its own; what a registrant announces stays its own and is capped per
instance; an oversized event frame is refused unread; an inventory line without end fails the
resync instead of the loop; registrants that stopped heartbeating are forgotten and free their
place; the listings need the admin token."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.credentials import instance_credential
from tests.integration.directory_helpers import DirectoryProcess, post
from tests.integration.hostile_registrant import HostileRegistrant, endless_line, peak_rss_bytes
from tests.integration.waiting import wait_for

pytestmark = pytest.mark.slow

ADMIN = "directory-admin-token"
SIDECAR = "the-sidecars-admin-token"


def cred(instance_id: str) -> str:
    return instance_credential(ADMIN, instance_id)


@pytest.fixture
def registrants() -> Iterator[list[HostileRegistrant]]:
    made: list[HostileRegistrant] = []
    yield made
    for r in made:
        r.close()


def start(tmp_path: Path, extra: str = "", static: HostileRegistrant | None = None) -> DirectoryProcess:
    config = tmp_path / "directory.toml"
    text = f'[http]\nadmin_token = "{ADMIN}"\n[directory]\nsidecar_token = "{SIDECAR}"\n' + extra
    if static is not None:
        text += (
            f'[[directory.static_instances]]\nid = "{static.name}"\nurl = "{static.url}"\n'
            f'events_endpoint = "{static.events_endpoint}"\n'
        )
    config.write_text(text)
    return DirectoryProcess(config)


def register(d: DirectoryProcess, spec: dict[str, object], token: str) -> tuple[int, object]:
    return post(d.http + "/v1/instances", spec, token=token)


def test_sidecar_token_only_to_static_urls(tmp_path: Path, registrants: list[HostileRegistrant]) -> None:
    static, evil = HostileRegistrant("static"), HostileRegistrant("evil")
    registrants += [static, evil]
    d = start(tmp_path, static=static)
    try:
        wait_for(lambda: len(static.authorizations) >= 1, 20, "the static instance's resync")
        assert static.authorizations[0] == f"Bearer {SIDECAR}"
        # a registrant (here with the admin token, as every sidecar held it) names its own URL
        assert register(d, evil.spec(), ADMIN)[0] == 200
        wait_for(lambda: len(evil.authorizations) >= 1, 20, "the registrant's resync")
        assert f"Bearer {SIDECAR}" not in evil.authorizations, "the sidecars' token went to a registrant"
        assert set(evil.authorizations) == {f"Bearer {cred('evil')}"}  # what it holds already
    finally:
        d.stop()


def test_credential_registers_only_its_own_id(tmp_path: Path, registrants: list[HostileRegistrant]) -> None:
    victim, attacker, static = HostileRegistrant("a", [11, 12, 13]), HostileRegistrant("b", [11, 12, 99]), \
        HostileRegistrant("s")  # fmt: skip
    registrants += [victim, attacker, static]
    d = start(tmp_path, static=static)
    try:
        assert register(d, victim.spec(), cred("a"))[0] == 200
        assert register(d, attacker.spec(), cred("b"))[0] == 200
        wait_for(lambda: {i["id"]: i["synced"] for i in d.instances().values()} == {"a": True, "b": True,
                                                                                   "s": True}, 20, "synced")
        # b's credential does not register a, with or without a's endpoints
        assert register(d, attacker.spec("a"), cred("b"))[0] == 401
        assert register(d, victim.spec(), cred("b"))[0] == 401
        # the admin token neither moves a live instance nor a static one
        status, body = register(d, attacker.spec("a"), ADMIN)
        assert status == 409, body
        assert register(d, attacker.spec("s"), cred("s"))[0] == 409
        listed = d.instances()
        assert listed["a"]["url"] == victim.url and listed["s"]["url"] == static.url
        assert len(attacker.authorizations) == 1  # b's own resync only: nothing came for a or s
        # what b claims stays b's: a's holdings unchanged, b holds its own listing
        assert listed["a"]["chunks"] == {"CPU": 3} and listed["b"]["chunks"] == {"CPU": 3}
        # a's own credential moves a's endpoints
        moved = HostileRegistrant("a", [11])
        registrants.append(moved)
        status, body = register(d, moved.spec(), cred("a"))
        assert status == 200 and body["status"] == "updated", body  # type: ignore[index]
        wait_for(lambda: d.instances()["a"]["chunks"] == {"CPU": 1}, 20, "a resynced from its new URL")
    finally:
        d.stop()


def test_chunks_capped_per_instance(tmp_path: Path, registrants: list[HostileRegistrant]) -> None:
    evil = HostileRegistrant("evil", list(range(1, 3001)))
    registrants.append(evil)
    d = start(tmp_path, "max_chunks_per_instance = 1000\n")
    try:
        assert register(d, evil.spec(), cred("evil"))[0] == 200
        wait_for(lambda: d.instances()["evil"]["synced"], 20, "the listing read")
        assert d.instances()["evil"]["chunks"] == {"CPU": 1000}
        # live stores past the cap: dropped too (published until one batch arrived)
        wait_for(lambda: publish_seen(d, evil, list(range(5000, 7000))), 20, "a batch")
        assert d.instances()["evil"]["chunks"] == {"CPU": 1000}
        assert d.metric("kvdepot_directory_chunks_capped_total") >= 4000
    finally:
        d.stop()


def publish_seen(d: DirectoryProcess, r: HostileRegistrant, hashes: list[int]) -> bool:
    r.publish(0, hashes)
    return d.metric("kvdepot_directory_batches_total") >= 1


def test_oversized_event_frame_refused_unread(tmp_path: Path, registrants: list[HostileRegistrant]) -> None:
    evil = HostileRegistrant("evil")
    registrants.append(evil)
    d = start(tmp_path, "max_event_bytes = 1048576\n")
    try:
        assert register(d, evil.spec(), cred("evil"))[0] == 200
        wait_for(lambda: d.instances()["evil"]["synced"], 20, "subscribed and synced")
        before = peak_rss_bytes(d.proc.pid)
        frame = bytearray(192 << 20)
        # sent until the directory's socket was connected to take it (PUB drops with no peer)
        wait_for(lambda: sent_big(d, evil, frame), 60, "a frame the directory took or refused")
        grown = peak_rss_bytes(d.proc.pid) - before
        assert grown < 64 << 20, f"the directory's peak RSS grew {grown >> 20} MiB for one frame"
        assert d.get("/health") == b"OK"
    finally:
        d.stop()


def sent_big(d: DirectoryProcess, r: HostileRegistrant, frame: bytearray) -> bool:
    r.publish_raw([b"", (0).to_bytes(8, "big"), frame])
    return d.metric("kvdepot_directory_bad_batches_total") >= 1 or refusals(d) >= 1


def refusals(d: DirectoryProcess) -> float:
    return d.metric("kvdepot_directory_event_disconnects_total")


def test_inventory_line_without_end_fails_the_resync(
    tmp_path: Path, registrants: list[HostileRegistrant]
) -> None:
    evil = HostileRegistrant("evil")
    evil.body = lambda: endless_line(48 << 20)
    registrants.append(evil)
    d = start(tmp_path)
    try:
        assert register(d, evil.spec(), cred("evil"))[0] == 200
        wait_for(lambda: "line" in d.instances()["evil"]["last_error"], 20, "the resync refused")
        assert not d.instances()["evil"]["synced"]
        assert d.get("/health") == b"OK"
    finally:
        d.stop()


def test_silent_registrants_forgotten(tmp_path: Path, registrants: list[HostileRegistrant]) -> None:
    real = HostileRegistrant("real")
    registrants.append(real)
    squatters = [HostileRegistrant(f"x{i}") for i in range(2)]
    registrants += squatters
    d = start(tmp_path, "max_instances = 2\ninstance_timeout_s = 0.5\nforget_after = 2\n")
    try:
        for s in squatters:
            assert register(d, s.spec(), cred(s.name))[0] == 200
        status, _ = register(d, real.spec(), cred("real"))
        assert status == 503  # full while they are live
        # they never heartbeat again: after 2 x 0.5 s they are forgotten, their places free
        wait_for(lambda: register(d, real.spec(), cred("real"))[0] == 200, 20, "a place for the real one")
        wait_for(lambda: set(d.instances()) == {"real"}, 20, "the squatters forgotten")
    finally:
        d.stop()


def test_listings_need_the_token(tmp_path: Path) -> None:
    d = start(tmp_path)
    try:
        for path in ("/v1/instances", "/metrics"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(d.http + path, timeout=5)
            assert err.value.code == 401, path
            err.value.close()
            assert d.get(path)  # with the token
        assert d.get("/health") == b"OK"
    finally:
        d.stop()
