"""The plain baselines of `kvdepot bench l2`: what a program without kvdepot does with the same
bytes, at the same concurrency as the adapter, measured in the same run.

A Baseline gets the chunks and `threads` (N, the adapter's own I/O threads:
the config's transfer_threads()); its workers take one chunk per task. The harness (bench/l2.py)
calls each phase right after the adapter's phase of the same kind:
  disk   store      open + write + fsync + close of one file per chunk
         load_warm  open + read of each file into preallocated shared memory, the files just
                    written (page-cache reads)
         drop, load_cold
                    the same after every file was dropped from the page cache (posix_fadvise
                    DONTNEED of the clean, fsync-ed pages): reads from the device
  redis  store      SET of each chunk, N redis-py clients (one connection each, one per thread)
         load_warm  GET of each chunk on the same connections; no cold reads: Redis serves from
                    its own memory, there is no page cache to drop
  mock   store      a copy of each chunk into fresh memory, load_warm a copy of each copy into
                    preallocated shared memory (one thread: what an in-memory tier cannot beat);
                    no cold reads

Every load checks, outside its timing, that it read back the bytes stored (`ok`).
State: the baseline's threads, files, memory or connections, all freed by close().

Also `drop_cached` (evict a directory's files from the page cache), `cpu_seconds` (the Redis main
thread's CPU time from INFO cpu) and `mac_cost` (keyed BLAKE3 against xxh3, one thread).
"""

from __future__ import annotations

import itertools
import mmap
import os
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from storage.redis.cluster import seed_urls


def drop_cached(root: Path) -> None:
    """Evict every file under `root` from the page cache (its pages are clean: written and
    fsync-ed), so that the next reads come from the device."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class Baseline:
    """One plain baseline over `chunks` with `threads` workers, its phases called in order:
    store(), load_warm(), then, where `cold` applies, drop() and load_cold(); each answers its
    seconds. `ok` says whether every load gave back the bytes stored. close() frees everything."""

    cold = False

    def __init__(self, chunks: Sequence[bytes], threads: int) -> None:
        self.chunks = chunks
        self.threads = max(1, threads)
        self.ok = True
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvdepot-baseline")

    def _timed(self, fn: Callable[[int], object], n: int) -> float:
        """Seconds until fn(0) .. fn(n - 1), run by the pool's threads, are all done."""
        start = time.perf_counter()
        for _ in self._pool.map(fn, range(n)):
            pass
        return time.perf_counter() - start

    def store(self) -> float:
        raise NotImplementedError

    def load_warm(self) -> float:
        raise NotImplementedError

    def drop(self) -> None:
        raise NotImplementedError(f"{type(self).__name__}: no cold reads")

    def load_cold(self) -> float:
        raise NotImplementedError(f"{type(self).__name__}: no cold reads")

    def close(self) -> None:
        self._pool.shutdown()


class DiskBaseline(Baseline):
    """open + write + fsync + close of one file per chunk under `root`; open + read of each file
    into preallocated shared memory (touched beforehand, as the L1 arena is), from the page cache
    and, after drop(), from the device."""

    cold = True

    def __init__(self, root: Path, chunks: Sequence[bytes], threads: int) -> None:
        super().__init__(chunks, threads)
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self._paths = [root / f"baseline-{i}" for i in range(len(chunks))]
        self._mem, self._outs = arena_like(chunks)

    def _write(self, i: int) -> None:
        fd = os.open(self._paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(self.chunks[i])
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    def _read(self, i: int) -> None:
        with open(self._paths[i], "rb", buffering=0) as f:
            view = memoryview(self._outs[i])
            while view:
                n = f.readinto(view)
                if not n:
                    raise OSError(f"{self._paths[i]} ended early")
                view = view[n:]

    def _check(self) -> None:
        self.ok = self.ok and all(o == c for o, c in zip(self._outs, self.chunks, strict=True))
        zero_all(self._outs)

    def store(self) -> float:
        return self._timed(self._write, len(self.chunks))

    def load_warm(self) -> float:
        seconds = self._timed(self._read, len(self.chunks))
        self._check()
        return seconds

    def drop(self) -> None:
        drop_cached(self.root)

    def load_cold(self) -> float:
        return self.load_warm()

    def close(self) -> None:
        super().close()
        for path in self._paths:
            path.unlink(missing_ok=True)
        free_arena(self._mem, self._outs)


def is_cluster(url: str) -> bool:
    """Whether the Redis at `url` (one node's URL) is a Redis Cluster node (INFO cluster)."""
    import redis

    with redis.Redis.from_url(url, socket_timeout=10) as r:
        return bool(r.info("cluster").get("cluster_enabled"))


def server_cpu_seconds(url: str) -> float:
    """cpu_seconds of the Redis at `url`, summed over every primary of a Redis Cluster."""
    import redis

    seed = seed_urls(url)[0]
    if not is_cluster(seed):
        with redis.Redis.from_url(seed, socket_timeout=10) as r:
            return cpu_seconds(r.info("cpu"))
    with redis.RedisCluster.from_url(seed, socket_timeout=10) as rc:
        return sum(cpu_seconds(rc.info("cpu", target_nodes=node)) for node in rc.get_primaries())


def cpu_seconds(info: dict[str, Any]) -> float:
    """The Redis main thread's CPU seconds (background threads, e.g. lazy frees, apart)."""
    main = ("used_cpu_sys_main_thread", "used_cpu_user_main_thread")
    names = main if all(n in info for n in main) else ("used_cpu_sys", "used_cpu_user")
    return sum(float(info[n]) for n in names)


class RedisBaseline(Baseline):
    """`threads` plain redis-py clients, each with its own connection (made before the clock
    starts, as the adapter's are by its first batch) used by one thread: thread t SETs, then GETs,
    chunks t, t + N, t + 2N, ... Redis holds values in memory: no cold reads. Against a Redis
    Cluster each client is a redis-py RedisCluster (slot-aware: one connection per node, each
    command sent to its key's node), connected to every node before the clock starts."""

    def __init__(self, url: str, chunks: Sequence[bytes], threads: int) -> None:
        import redis

        super().__init__(chunks, threads)
        self._prefix = f"kvdepot-bench-baseline-{uuid.uuid4().hex[:8]}:"
        # redis-py's 5 s socket timeout is short for a 32 MiB value on a busy machine; a baseline
        # that gives up is no figure (the adapter's lane allows timeout_s + bytes at 64 MB/s).
        seed = seed_urls(url)[0]
        self.cluster = is_cluster(seed)
        self._clients: list[Any] = [
            redis.RedisCluster.from_url(seed, socket_timeout=120)
            if self.cluster
            else redis.Redis.from_url(seed, single_connection_client=True, socket_timeout=120)
            for _ in range(self.threads)
        ]
        for c in self._clients:
            if self.cluster:  # a connection to every node, as the adapter's first batch makes
                for node in c.get_primaries():
                    c.ping(target_nodes=node)
            else:
                c.ping()
        self._got: list[object] = [None] * len(chunks)

    def _sets(self, t: int) -> None:
        for i in range(t, len(self.chunks), self.threads):
            self._clients[t].set(f"{self._prefix}{i}", self.chunks[i])

    def _gets(self, t: int) -> None:
        for i in range(t, len(self.chunks), self.threads):
            self._got[i] = self._clients[t].get(f"{self._prefix}{i}")

    def store(self) -> float:
        return self._timed(self._sets, self.threads)

    def load_warm(self) -> float:
        seconds = self._timed(self._gets, self.threads)
        self.ok = self.ok and all(g == c for g, c in zip(self._got, self.chunks, strict=True))
        self._got = [None] * len(self.chunks)
        return seconds

    def close(self) -> None:
        super().close()
        for i in range(len(self.chunks)):
            self._clients[i % self.threads].unlink(f"{self._prefix}{i}")
        for c in self._clients:
            c.close()


class MemoryBaseline(Baseline):
    """A copy of each chunk into fresh memory (what the mock does with a blob), then a copy of each
    copy into preallocated shared memory (as a load lands in L1), one thread: what an in-memory
    tier cannot beat."""

    def __init__(self, chunks: Sequence[bytes]) -> None:
        super().__init__(chunks, 1)
        self._copies: list[bytearray] = []
        self._mem, self._outs = arena_like(chunks)

    def store(self) -> float:
        start = time.perf_counter()
        self._copies = [bytearray(c) for c in self.chunks]
        return time.perf_counter() - start

    def load_warm(self) -> float:
        start = time.perf_counter()
        for out, copy in zip(self._outs, self._copies, strict=True):
            out[:] = copy
        seconds = time.perf_counter() - start
        self.ok = self.ok and all(o == c for o, c in zip(self._outs, self.chunks, strict=True))
        zero_all(self._outs)
        return seconds

    def close(self) -> None:
        super().close()
        free_arena(self._mem, self._outs)


def arena_like(chunks: Sequence[bytes]) -> tuple[mmap.mmap, list[memoryview]]:
    """One shared mapping with a region per chunk, every page touched: the kind of memory the L1
    arena is (a private heap buffer per chunk takes reads markedly slower here, and first-touch
    faults inside a timed phase would flatter the adapter)."""
    mem = mmap.mmap(-1, max(1, sum(len(c) for c in chunks)))
    offsets = list(itertools.accumulate((len(c) for c in chunks), initial=0))
    whole = memoryview(mem)
    outs = [whole[a:b] for a, b in itertools.pairwise(offsets)]
    whole.release()
    zero_all(outs)
    return mem, outs


def zero_all(outs: list[memoryview]) -> None:
    for out in outs:
        out[:] = bytes(len(out))


def free_arena(mem: mmap.mmap, outs: list[memoryview]) -> None:
    for out in outs:
        out.release()
    mem.close()


def mac_cost(chunks: Sequence[bytes], load_s: float) -> dict[str, float]:
    """One thread: keyed BLAKE3 and xxh3 over the chunks, in GB/s; the MAC's share of load_s."""
    import blake3
    import xxhash

    key = bytes(32)
    start = time.perf_counter()
    for chunk in chunks:
        blake3.blake3(chunk, key=key).digest()
    mac_s = time.perf_counter() - start
    start = time.perf_counter()
    for chunk in chunks:
        xxhash.xxh3_128_digest(chunk)
    xxh3_s = time.perf_counter() - start
    total = sum(len(c) for c in chunks)
    return {"mac_gbps": gbps(total, mac_s), "xxh3_gbps": gbps(total, xxh3_s),
            "load_share": round(mac_s / load_s, 3)}  # fmt: skip


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)
