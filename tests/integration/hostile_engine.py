"""A hostile engine client, run as its own process by the write-domain tests and the soak.

    python -m tests.integration.hostile_engine overwrite URL SEED CHUNKS SALT

overwrite: a real client (its own engine instance) looks up and locks the CHUNKS chunks of
request_tokens(SEED, CHUNKS) under SALT (another instance stored them), finds their extents in its
own mapping of the arena, and tries to make them writable: mprotect(PROT_READ|PROT_WRITE) on its
mapping, a writable shared mmap of every descriptor its lifeline brought, a read-write reopen of
them through /proc. It prints one JSON line with what each attempt got (errno names, or "ok"),
then writes 0xEE over the first chunk through its mapping and prints "wrote" (a write domain
stops it there: SIGSEGV).
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import sys

from kvdepot_connector.lifeline import LifelineClient
from tests.integration.dp_client import client, request_tokens

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _errno_name(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, str(exc.errno))


def try_mprotect(addr: int, size: int) -> str:
    page = addr - addr % mmap.PAGESIZE
    if _libc.mprotect(page, size + addr - page, mmap.PROT_READ | mmap.PROT_WRITE) == 0:
        return "ok"
    return errno.errorcode.get(ctypes.get_errno(), "?")


def try_descriptors(url: str) -> dict[str, str]:
    """Connect a second lifeline of our own (a fresh HELLO) and attack every descriptor it brings."""
    from tests.integration.test_arena_memfd import hello

    reply = hello(url)
    line = LifelineClient(reply.lifeline_path, reply.lifeline_token)
    out: dict[str, str] = {}
    try:
        for name, fd in line.received.items():
            size = os.fstat(fd).st_size
            try:
                m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                m.close()
                out[f"mmap_rw:{name}"] = "ok"
            except OSError as exc:
                out[f"mmap_rw:{name}"] = _errno_name(exc)
            try:
                os.close(os.open(f"/proc/self/fd/{fd}", os.O_RDWR))
                out[f"reopen_rw:{name}"] = "ok"
            except OSError as exc:
                out[f"reopen_rw:{name}"] = _errno_name(exc)
    finally:
        line.close()
    return out


def overwrite(url: str, seed: int, chunks: int, salt: str) -> None:
    c = client(url)
    toks = request_tokens(seed, chunks)
    hit = c.lookup(toks, request_id="h", cache_salt=salt)
    locked = c.locked("h", first_chunk=0, num_chunks=hit.hit_chunks)
    c.release("h", locked.oids)
    view = locked.views[0]
    report = {
        "hit": hit.hit_chunks,
        "mprotect": try_mprotect(view.data_ptr(), view.numel()),
        **try_descriptors(url),
    }
    print(json.dumps(report), flush=True)
    ctypes.memset(view.data_ptr(), 0xEE, view.numel())  # through the mapping, as is
    print("wrote", flush=True)
    c.close()


def main() -> None:
    mode, url = sys.argv[1], sys.argv[2]
    if mode == "overwrite":
        overwrite(url, int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
