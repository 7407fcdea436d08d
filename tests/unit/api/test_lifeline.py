"""The lifeline server with real unix sockets and real client processes: who may connect, what
it learns when a client dies, and how it bounds what a hostile client sends."""

from __future__ import annotations

import array
import asyncio
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from api.lifeline import Lifeline, LifelineLimits, LifelineRefused, LifelineServer, SharedRegion
from kvdepot_connector.lifeline import HEADER, LifelineClient, LifelineError, Share, encode_frame

TOKEN = b"t" * 32
ROOT = Path(__file__).resolve().parents[3]


class Recorder:
    """The callbacks a sidecar gives the server, recording what they saw."""

    def __init__(self, *, refuse: bool = False) -> None:
        self.regions: list[SharedRegion] = []
        self.closed: list[Lifeline] = []
        self.closed_event = asyncio.Event()
        self.refuse = refuse
        self.offered = os.memfd_create("offered")
        os.ftruncate(self.offered, 4096)

    def authenticate(self, token: bytes) -> object | None:
        return "holder-1" if token == TOKEN else None

    def offer(self, holder: object) -> list[tuple[str, int]]:
        return [("arena", self.offered)]

    def on_fds(self, line: Lifeline, regions: list[SharedRegion]) -> None:
        if self.refuse:
            for r in regions:
                os.close(r.fd)
            raise LifelineRefused("not sealed")
        self.regions.extend(regions)

    def on_closed(self, line: Lifeline) -> None:
        self.closed.append(line)
        self.closed_event.set()


def run(
    body: Callable[[LifelineServer, Recorder], Awaitable[None]], tmp_path: Path, **kw: object
) -> Recorder:
    async def main() -> Recorder:
        rec = Recorder(refuse=bool(kw.pop("refuse", False)))
        server = LifelineServer(
            tmp_path / "lifeline.sock", authenticate=rec.authenticate, on_fds=rec.on_fds,
            on_closed=rec.on_closed, offer=rec.offer, limits=LifelineLimits(**kw),  # type: ignore[arg-type]
        )  # fmt: skip
        server.start()
        try:
            await body(server, rec)
        finally:
            server.close()
            for r in rec.regions:
                os.close(r.fd)
            os.close(rec.offered)
        return rec

    return asyncio.run(main())


def raw(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(path))
    return sock


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_client_with_the_token_gets_the_offer_and_shares_regions(tmp_path: Path) -> None:
    async def body(server: LifelineServer, rec: Recorder) -> None:
        assert oct(os.stat(server.path).st_mode & 0o777) == "0o660"
        client = await asyncio.to_thread(LifelineClient, server.path, TOKEN)
        arena = client.take("arena")
        assert os.fstat(arena).st_size == 4096  # the very memfd the server offered
        assert not os.get_inheritable(arena)
        os.close(arena)
        region = os.memfd_create("region")
        os.ftruncate(region, 8192)
        await asyncio.to_thread(client.share, [("kv0", region, 8192)])
        os.close(region)
        [got] = rec.regions
        assert (got.name, got.size, os.fstat(got.fd).st_size) == ("kv0", 8192, 8192)
        assert not os.get_inheritable(got.fd)  # never leaks into a process the sidecar starts
        [line] = server.lines
        assert (line.pid, line.uid, line.holder) == (os.getpid(), os.getuid(), "holder-1")
        client.close()
        await asyncio.wait_for(rec.closed_event.wait(), 10)

    rec = run(body, tmp_path)
    assert len(rec.closed) == 1


def test_a_killed_client_process_is_noticed_at_once(tmp_path: Path) -> None:
    script = (
        "import sys, time\n"
        "from kvdepot_connector.lifeline import LifelineClient\n"
        f"c = LifelineClient({str(tmp_path / 'lifeline.sock')!r}, {TOKEN!r})\n"
        "print('connected', flush=True)\n"
        "time.sleep(600)\n"
    )

    async def body(server: LifelineServer, rec: Recorder) -> None:
        env = dict(os.environ, PYTHONPATH=f"{ROOT / 'connector'}:{ROOT}")
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE, env=env
        )
        assert child.stdout is not None
        assert await asyncio.wait_for(child.stdout.readline(), 30) == b"connected\n"
        [line] = server.lines
        assert line.pid == child.pid
        assert rec.closed == []
        child.send_signal(signal.SIGKILL)
        await asyncio.wait_for(rec.closed_event.wait(), 10)
        assert rec.closed == [line]
        await child.wait()

    run(body, tmp_path)


def test_an_unknown_token_is_refused_and_closed(tmp_path: Path) -> None:
    async def body(server: LifelineServer, rec: Recorder) -> None:
        with pytest.raises(LifelineError, match="unknown token"):
            await asyncio.to_thread(LifelineClient, server.path, b"guess")
        assert server.lines == set()
        assert server.refused == 1

    rec = run(body, tmp_path)
    assert rec.closed == []  # never a holder, so nothing to fence


def test_a_share_before_hello_is_refused(tmp_path: Path) -> None:
    async def body(server: LifelineServer, rec: Recorder) -> None:
        before = open_fds()
        sock = raw(server.path)
        region = os.memfd_create("early")
        sock.sendmsg([encode_frame(Share(names=["x"], sizes=[1]))],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [region]))])  # fmt: skip
        os.close(region)
        assert await asyncio.to_thread(_read_until_eof, sock)
        assert rec.regions == []
        assert open_fds() == before  # the server kept none of it

    run(body, tmp_path)


def _read_until_eof(sock: socket.socket) -> bytes:
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    sock.close()
    return got


@pytest.mark.parametrize("per_message", [True, False], ids=["per-message", "per-connection"])
def test_too_many_descriptors_close_the_lifeline_and_leak_none(tmp_path: Path, per_message: bool) -> None:
    async def body(server: LifelineServer, rec: Recorder) -> None:
        client = await asyncio.to_thread(LifelineClient, server.path, TOKEN)
        before = open_fds()
        region = os.memfd_create("many")
        os.ftruncate(region, 4096)
        batches = [[region] * 9] if per_message else [[region] * 4] * 3
        for batch in batches[:-1]:
            await asyncio.to_thread(client.share, [(f"r{i}", fd, 4096) for i, fd in enumerate(batch)])
        last = [(f"r{i}", fd, 4096) for i, fd in enumerate(batches[-1])]
        with pytest.raises(LifelineError):
            await asyncio.to_thread(client.share, last)
        await asyncio.wait_for(rec.closed_event.wait(), 10)
        os.close(region)
        client.close()
        assert len(rec.regions) == (0 if per_message else 8)
        for r in rec.regions:
            os.close(r.fd)
        rec.regions.clear()
        assert open_fds() <= before - 1  # both ends of the socket gone, nothing kept by the server

    run(body, tmp_path, max_fds_per_message=8, max_fds_per_connection=10)


def test_garbage_and_oversized_frames_close_the_lifeline(tmp_path: Path) -> None:
    async def body(server: LifelineServer, rec: Recorder) -> None:
        for junk in [b"\x00\x00\x00\x05hello", HEADER.pack(1 << 30) + b"x", b"GET / HTTP/1.1\r\n\r\n"]:
            sock = raw(server.path)
            sock.sendall(junk)
            await asyncio.to_thread(_read_until_eof, sock)
        assert server.lines == set()
        client = await asyncio.to_thread(LifelineClient, server.path, TOKEN)  # still serving
        client.close()

    run(body, tmp_path)


def test_a_client_that_says_nothing_is_closed_after_the_handshake_timeout(tmp_path: Path) -> None:
    async def body(server: LifelineServer, rec: Recorder) -> None:
        sock = raw(server.path)
        assert await asyncio.to_thread(_read_until_eof, sock) == b""
        assert server.lines == set()

    run(body, tmp_path, handshake_timeout_s=0.2)


def test_connections_past_the_limit_are_refused(tmp_path: Path) -> None:
    async def body(server: LifelineServer, rec: Recorder) -> None:
        clients = [await asyncio.to_thread(LifelineClient, server.path, TOKEN) for _ in range(2)]
        with pytest.raises(LifelineError):
            await asyncio.to_thread(LifelineClient, server.path, TOKEN)
        clients.pop().close()
        await asyncio.wait_for(rec.closed_event.wait(), 10)
        clients.append(await asyncio.to_thread(LifelineClient, server.path, TOKEN))
        for c in clients:
            c.close()

    run(body, tmp_path, max_connections=2)


def test_lifelines_of_one_uid_are_capped(tmp_path: Path) -> None:
    async def body(server: LifelineServer, rec: Recorder) -> None:
        clients = [await asyncio.to_thread(LifelineClient, server.path, TOKEN) for _ in range(2)]
        with pytest.raises(LifelineError):  # this process's uid holds its 2 already
            await asyncio.to_thread(LifelineClient, server.path, TOKEN)
        assert server.refused == 1 and len(server.lines) == 2
        clients.pop().close()
        await asyncio.wait_for(rec.closed_event.wait(), 10)
        clients.append(await asyncio.to_thread(LifelineClient, server.path, TOKEN))  # its place is free
        for c in clients:
            c.close()

    run(body, tmp_path, max_connections_per_uid=2)


def test_a_refused_share_closes_its_descriptors_and_keeps_the_lifeline(tmp_path: Path) -> None:
    async def body(server: LifelineServer, rec: Recorder) -> None:
        client = await asyncio.to_thread(LifelineClient, server.path, TOKEN)
        region = os.memfd_create("unsealed")
        before = open_fds()
        with pytest.raises(LifelineError, match="not sealed"):
            await asyncio.to_thread(client.share, [("r", region, 4096)])
        assert open_fds() == before
        assert len(server.lines) == 1
        os.close(region)
        client.close()

    run(body, tmp_path, refuse=True)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client under another uid")
def test_a_client_of_another_uid_is_refused() -> None:
    where = Path(tempfile.mkdtemp(prefix="kvdepot-lifeline-", dir="/tmp"))  # reachable by any uid
    script = (
        "import os\n"
        "from kvdepot_connector.lifeline import LifelineClient, LifelineError\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "try:\n"
        f"    LifelineClient({str(where / 'lifeline.sock')!r}, {TOKEN!r})\n"
        "    print('admitted')\n"
        "except LifelineError as exc:\n"
        "    print('refused', exc)\n"
    )

    async def body(server: LifelineServer, rec: Recorder) -> None:
        os.chmod(where, 0o777)
        os.chmod(server.path, 0o666)  # let the other uid reach the socket: only the peer check is left
        env = dict(os.environ, PYTHONPATH=f"{ROOT / 'connector'}:{ROOT}")
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE, env=env
        )
        out, _ = await asyncio.wait_for(child.communicate(), 60)
        assert out.startswith(b"refused"), out
        assert server.refused == 1  # connected, and dropped by the peer-credential check
        assert server.lines == set()

    try:
        run(body, where)
    finally:
        shutil.rmtree(where)
