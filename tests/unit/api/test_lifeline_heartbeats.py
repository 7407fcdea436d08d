"""Heartbeats over the lifeline, with real unix sockets: the client's own thread sends them and
the server hands each to `on_heartbeat`; a malformed one closes that lifeline only; a flood is
read a bounded amount per wake, so the loop keeps serving the rest."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from api.lifeline import Lifeline, LifelineLimits, LifelineServer
from kvdepot_connector.lifeline import HEADER, Heartbeat, Heartbeats, LifelineClient, encode_frame
from tests.unit.api.test_lifeline import TOKEN, Recorder


def serve(tmp_path: Path, rec: Recorder, beats: list[Lifeline], **limits: int) -> LifelineServer:
    server = LifelineServer(
        tmp_path / "lifeline.sock", authenticate=rec.authenticate, on_fds=rec.on_fds,
        on_closed=rec.on_closed, offer=rec.offer, on_heartbeat=beats.append,
        limits=LifelineLimits(**limits),  # type: ignore[arg-type]
    )  # fmt: skip
    server.start()
    return server


async def until(predicate: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while not predicate():  # noqa: ASYNC110  (a predicate on state the loop itself updates)
            await asyncio.sleep(0.01)


def test_the_clients_thread_heartbeats_until_stopped(tmp_path: Path) -> None:
    async def main() -> None:
        rec, beats = Recorder(), list[Lifeline]()
        server = serve(tmp_path, rec, beats)
        client = await asyncio.to_thread(LifelineClient, server.path, TOKEN)
        arena = client.take("arena")
        hb = Heartbeats(client, 0.02).start()
        await until(lambda: len(beats) >= 5)
        hb.stop()
        sent = hb.sent
        await asyncio.sleep(0.1)
        assert len(beats) == sent and rec.closed == []  # every one arrived; none after stop
        client.close()
        await asyncio.wait_for(rec.closed_event.wait(), 10)
        server.close()
        os.close(arena)
        os.close(rec.offered)

    asyncio.run(main())


def test_a_malformed_heartbeat_closes_that_lifeline_only(tmp_path: Path) -> None:
    async def main() -> None:
        rec, beats = Recorder(), list[Lifeline]()
        server = serve(tmp_path, rec, beats)
        bad = await asyncio.to_thread(LifelineClient, server.path, TOKEN)
        good = await asyncio.to_thread(LifelineClient, server.path, TOKEN)
        body = msgspec.msgpack.encode({"op": "heartbeat", "seq": -1})
        sock = bad._sock
        await asyncio.to_thread(sock.sendall, HEADER.pack(len(body)) + body)
        await asyncio.wait_for(rec.closed_event.wait(), 10)
        assert len(rec.closed) == 1 and len(server.lines) == 1
        await asyncio.to_thread(good.heartbeat, 1)
        await until(lambda: len(beats) == 1)
        for c in (bad, good):
            c.close()
        server.close()
        os.close(rec.offered)

    asyncio.run(main())


def test_a_heartbeat_flood_is_read_a_bounded_amount_per_wake(tmp_path: Path) -> None:
    async def main() -> None:
        rec, beats = Recorder(), list[Lifeline]()
        server = serve(tmp_path, rec, beats, max_read_per_wake=4096)
        flooder = await asyncio.to_thread(LifelineClient, server.path, TOKEN)
        frame = encode_frame(Heartbeat(seq=1))
        burst = frame * ((1 << 20) // len(frame))
        stop = threading.Event()

        def flood() -> None:
            try:
                while not stop.is_set():
                    flooder._sock.sendall(burst)
            except OSError:
                return  # the server closed it

        thread = threading.Thread(target=flood, daemon=True)
        thread.start()
        await until(lambda: len(beats) > 1000)
        ticks = 0
        start = time.monotonic()
        while time.monotonic() - start < 0.5:  # the loop keeps turning while the flood goes on
            await asyncio.sleep(0)
            ticks += 1
        got = len(beats)
        await until(lambda: len(beats) > got)  # and the flooder is still being read
        stop.set()
        assert ticks > 100, ticks
        server.close()  # closes the flooder's lifeline: its sendall fails, the thread ends
        thread.join(10)
        flooder.close()
        os.close(rec.offered)

    asyncio.run(main())
