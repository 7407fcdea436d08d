"""A real directory and a registered instance that publishes big KV-event frames while the
directory is busy with it (its inventory answers only when the test says): the received events
wait in a queue bounded in bytes (`directory.max_queued_event_bytes`), not in messages only, so
the directory's RSS stays within a bound; what did not fit is dropped, counted, and the instance
is resynced from its inventory afterwards instead of losing those events silently."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.credentials import instance_credential
from tests.integration.directory_helpers import DirectoryProcess, post
from tests.integration.hostile_registrant import HostileRegistrant, listing, peak_rss_bytes
from tests.integration.waiting import wait_for

pytestmark = pytest.mark.slow

ADMIN = "directory-admin-token"
FRAME = 1 << 20
FRAMES = 320
QUEUED = 16 << 20
#: the queue's bound, the frame being handled and the allocator's slack: far less than FRAMES MiB
GROWTH_BOUND = QUEUED + (96 << 20)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def evil() -> Iterator[HostileRegistrant]:
    r = HostileRegistrant("evil", sndhwm=0)  # the publisher keeps every frame: the directory bounds
    yield r
    r.close()


def test_big_event_frames_queue_within_a_byte_bound_and_resync_the_instance(
    tmp_path: Path, evil: HostileRegistrant
) -> None:
    config = tmp_path / "directory.toml"
    config.write_text(
        f'[http]\nadmin_token = "{ADMIN}"\n[directory]\nmax_queued_event_bytes = {QUEUED}\n'
    )
    d = DirectoryProcess(config)
    gate = threading.Event()
    try:
        status, _ = post(d.http + "/v1/instances", evil.spec(), token=instance_credential(ADMIN, "evil"))
        assert status == 200
        wait_for(lambda: d.instances()["evil"]["synced"], 20, "subscribed and synced")
        # the next listing waits for the gate: the directory's task for this instance is busy
        listed = len(evil.authorizations)

        def held() -> Iterator[bytes]:
            gate.wait(120)
            yield from listing([1, 2, 3], incarnation="after")

        evil.body = held
        wait_for(lambda: publish_new_incarnation(evil, listed), 20, "a resync asked")
        start = rss_bytes(d.proc.pid)
        peak_before = peak_rss_bytes(d.proc.pid)
        payload = os.urandom(FRAME)
        for seq in range(FRAMES):
            evil.publish_raw([b"", (1000 + seq).to_bytes(8, "big"), payload])
        # every frame was taken in (queued or dropped), or the directory grew past the bound
        wait_for(
            lambda: dropped(d) >= FRAMES - QUEUED // FRAME
            or rss_bytes(d.proc.pid) - start > GROWTH_BOUND,
            60, "the frames taken in",
        )  # fmt: skip
        grown = rss_bytes(d.proc.pid) - start
        print(f"RSS grew {grown >> 20} MiB, {dropped(d):.0f} dropped")
        assert grown <= GROWTH_BOUND, f"the directory's RSS grew {grown >> 20} MiB for {FRAMES} frames"
        gate.set()
        wait_for(lambda: d.metric('kvdepot_directory_resyncs_total{reason="overflow"}') >= 1, 30, "a resync")
        wait_for(lambda: d.instances()["evil"]["chunks"] == {"CPU": 3}, 30, "the instance resynced")
        peak = peak_rss_bytes(d.proc.pid) - peak_before
        assert peak <= GROWTH_BOUND, f"the directory's peak RSS grew {peak >> 20} MiB"
        assert d.get("/health") == b"OK"
    finally:
        gate.set()
        d.stop()


def publish_new_incarnation(r: HostileRegistrant, listed: int) -> bool:
    r.publish(0, [99], incarnation=f"restart-{len(r.authorizations)}")
    return len(r.authorizations) > listed


def dropped(d: DirectoryProcess) -> float:
    return d.metric("kvdepot_directory_events_dropped_total")
