"""One soak client process: a writer, a reader or a hostile engine, through the blocking client library.

    python -m tests.soak.client ROLE URL STATS_FILE SEED UNTIL

Every chunk's bytes are a function of (tenant salt, the tokens up to the chunk's end), so any
reader can check any chunk. Writers reserve a document's chunks, fill them (many passes, as a slow
device copy would: a writer stopped meanwhile goes on writing when it is continued, into an
extent that may no longer be its own), then commit, or now and then abort. Readers look a document
up, take arena views of the locked chunks, copy them (many passes too), release, and verify every
byte of a release that said `valid=True`: a byte that differs is a wrong byte reported valid.
A hostile engine (an instance of its own) commits reservations it never wrote (under a tenant of
its own: what an engine writes for its own requests is its business) and tries to overwrite the
chunks readers look up, through its mapping: a write through /proc/self/mem at the locked view
(refused: the mapping is read-only and shared) and now and then a plain store from a forked child
(which a write domain kills with SIGSEGV). Counted: `overwrites_tried`, `overwrites_refused`,
`overwrites_done`, `commits_unwritten`.

State: the counters, written to STATS_FILE (atomically) every STATS_EVERY_S and at once when a
wrong byte is seen, so a SIGKILL loses counts of a moment but never a wrong byte. Runs until the
wall-clock time UNTIL.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvdepot_connector.client import KVDepotClient
from kvdepot_connector.errors import KVDepotClientError, SidecarError
from kvdepot_connector.protocol import Layout, SlotStatus

CHUNK_TOKENS = 16
LAYOUT = Layout(
    dtype="float16",
    num_layers=8,
    num_kv_heads=2,
    head_dim=64,
    block_size=16,
    kind="soak",
    chunk_size=CHUNK_TOKENS,
)  # fmt: skip  (64 KiB per chunk)
CHUNK_BYTES = LAYOUT.chunk_bytes
DOCS = 48
CHUNKS_PER_DOC = 8
TENANTS = 3
STATS_EVERY_S = 0.2


def doc_tokens(doc: int) -> list[int]:
    rng = random.Random(doc)
    return [rng.randrange(1 << 31) for _ in range(CHUNKS_PER_DOC * CHUNK_TOKENS)]


def expected(salt: str, tokens: list[int], chunk: int) -> torch.Tensor:
    """The bytes of chunk `chunk` of `tokens` under `salt`: a digest of everything that names it."""
    prefix = ",".join(map(str, tokens[: (chunk + 1) * CHUNK_TOKENS]))
    digest = hashlib.blake2b(f"{salt}|{prefix}".encode(), digest_size=64).digest()
    return torch.frombuffer(bytearray(digest * (CHUNK_BYTES // 64)), dtype=torch.uint8)


@dataclass
class Stats:
    role: str
    pid: int
    ops: int = 0
    stored_chunks: int = 0
    commits_expired: int = 0
    aborted: int = 0
    hit_chunks: int = 0
    bytes_verified: int = 0
    releases_invalid: int = 0
    wrong_bytes: int = 0
    wrong_chunks: int = 0
    wrong_examples: list[dict[str, object]] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    commits_unwritten: int = 0
    overwrites_tried: int = 0
    overwrites_refused: int = 0
    overwrites_done: int = 0


class SoakClient:
    def __init__(self, role: str, url: str, stats_file: Path, seed: int) -> None:
        self.role = role
        self.client = KVDepotClient(url, model="soak-model", layout=LAYOUT, timeout_s=5, name=role)
        self.stats = Stats(role, os.getpid())
        self.stats_file = stats_file
        self.rng = random.Random(seed)
        self._saved_at = 0.0
        self._n = 0

    def save(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._saved_at < STATS_EVERY_S:
            return
        self._saved_at = now
        tmp = self.stats_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self.stats)))
        os.replace(tmp, self.stats_file)

    def run(self, until: float) -> None:
        step = {"writer": self.write, "reader": self.read, "hostile": self.attack}[self.role]
        while time.time() < until:
            self._n += 1
            salt = f"tenant-{self.rng.randrange(TENANTS)}"
            doc = self.rng.randrange(DOCS)
            try:
                step(salt, doc, f"{self.role}-{os.getpid()}-{self._n}")
            except SidecarError as exc:
                self._error(exc.code)
            except KVDepotClientError as exc:
                self._error(type(exc).__name__)
            self.stats.ops += 1
            self.save()
        self.save(force=True)

    def _error(self, code: str) -> None:
        self.stats.errors[code] = self.stats.errors.get(code, 0) + 1

    def write(self, salt: str, doc: int, rid: str) -> None:
        tokens = doc_tokens(doc)
        reply = self.client.reserve(tokens, request_id=rid, cache_salt=salt)
        slots = [s for s in reply.slots if s.status is SlotStatus.RESERVED]
        pairs = [(self.client.slot_view(s), expected(salt, tokens, s.chunk)) for s in slots]
        for _ in range(self.rng.randint(20, 200)):  # a slow copy: stopped here, it goes on after
            for view, src in pairs:
                view.copy_(src)
        oids = [s.oid for s in slots]
        if self.rng.random() < 0.1:
            self.stats.aborted += self.client.abort(oids) if oids else 0
            return
        ok = self.client.commit(oids)
        self.stats.stored_chunks += sum(ok)
        self.stats.commits_expired += len(ok) - sum(ok)

    def read(self, salt: str, doc: int, rid: str) -> None:
        tokens = doc_tokens(doc)
        try:
            hit = self.client.lookup(tokens, request_id=rid, cache_salt=salt)
            if hit.hit_chunks == 0 or self.rng.random() < 0.1:
                return
            locked = self.client.locked(rid, first_chunk=0, num_chunks=hit.hit_chunks)
            outs = [torch.empty(CHUNK_BYTES, dtype=torch.uint8) for _ in locked.views]
            for _ in range(self.rng.randint(5, 50)):  # a slow copy out: stopped here, it goes on after
                for out, view in zip(outs, locked.views, strict=True):
                    out.copy_(view)
            valid = self.client.release(rid, locked.oids)  # the generation check of what was copied
        finally:
            self.client.end_request(rid)
        if not valid:
            self.stats.releases_invalid += 1
            return
        self.stats.hit_chunks += len(outs)
        for chunk, out in enumerate(outs):
            wrong = int((out != expected(salt, tokens, chunk)).sum())
            self.stats.bytes_verified += CHUNK_BYTES
            if wrong:
                self.stats.wrong_bytes += wrong
                self.stats.wrong_chunks += 1
                if len(self.stats.wrong_examples) < 10:
                    self.stats.wrong_examples.append(
                        {"salt": salt, "doc": doc, "chunk": chunk, "wrong": wrong}
                    )
                self.save(force=True)


    def attack(self, salt: str, doc: int, rid: str) -> None:
        """Commit unwritten memory under a tenant of its own, then try to overwrite `salt`'s chunks."""
        tokens = doc_tokens(doc)
        reply = self.client.reserve(tokens, request_id=rid + "-w", cache_salt="hostile")
        oids = [s.oid for s in reply.slots if s.status is SlotStatus.RESERVED]
        if oids:
            self.stats.commits_unwritten += sum(self.client.commit(oids))
        try:
            hit = self.client.lookup(tokens, request_id=rid, cache_salt=salt)
            if hit.hit_chunks == 0:
                return
            locked = self.client.locked(rid, first_chunk=0, num_chunks=hit.hit_chunks)
            view = locked.views[self.rng.randrange(len(locked.views))]
            self.stats.overwrites_tried += 1
            if self.rng.random() < 0.05:
                self._store_in_child(view.data_ptr(), view.numel())
            else:
                self._poke(view.data_ptr(), view.numel())
            self.client.release(rid, locked.oids)
        finally:
            self.client.end_request(rid)

    def _poke(self, addr: int, size: int) -> None:
        try:
            fd = os.open("/proc/self/mem", os.O_RDWR)
            try:
                os.pwrite(fd, b"\xee" * size, addr)
            finally:
                os.close(fd)
        except OSError:
            self.stats.overwrites_refused += 1
            return
        self.stats.overwrites_done += 1
        self.save(force=True)

    def _store_in_child(self, addr: int, size: int) -> None:
        pid = os.fork()
        if pid == 0:  # the child: a plain store through the mapping, then out
            ctypes.memset(addr, 0xEE, size)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            self.stats.overwrites_refused += 1
        else:
            self.stats.overwrites_done += 1
            self.save(force=True)


def main() -> None:
    role, url, stats_file, seed, until = sys.argv[1:6]
    torch.set_num_threads(1)  # several clients share few cores
    client = SoakClient(role, url, Path(stats_file), int(seed))
    client.save(force=True)
    client.run(float(until))


if __name__ == "__main__":
    main()
