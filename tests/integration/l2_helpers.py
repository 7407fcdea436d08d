"""Helpers shared by the L2 integration tests: keys as the sidecar names them, blob files on disk,
and a private redis-server that a test may stop and restart."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import redis

from engine.keys import KVLayout, Namespace, ObjectKey, TokenHasher
from kvdepot_connector.protocol import encode_tokens
from storage.codec import blob_header
from storage.disk.dirs import BLOB_SUFFIX
from storage.slab import headers as fmt
from tests.integration.dp_client import CHUNK_TOKENS, LAYOUT, request_tokens
from tests.ports import free_port

MODEL = "test-model"


def engine_layout() -> KVLayout:
    lay = LAYOUT
    return KVLayout(lay.dtype, lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_size, lay.kind,
                    lay.chunk_size)  # fmt: skip


def request_keys(seed: int, chunks: int, salt: str = "") -> list[str]:
    ns = Namespace(MODEL, engine_layout().fingerprint, 0, 0)
    toks = encode_tokens(request_tokens(seed, chunks))
    return [ObjectKey(ns, salt, h).serialize() for h in TokenHasher(CHUNK_TOKENS).chunk_hashes(toks)]


def blob_files(l2_dir: Path) -> dict[str, Path]:
    """key -> file, for every complete blob file under `l2_dir` (header valid, length right)."""
    found: dict[str, Path] = {}
    for path in l2_dir.rglob(f"*{BLOB_SUFFIX}"):
        data = path.read_bytes()
        try:
            header = blob_header.read_header(data)
        except Exception:
            continue
        if len(data) == header.total_len:
            found[header.key] = path
    return found


def slab_blobs(path: Path) -> dict[str, int]:
    """key -> blob bytes, for every key whose newest slot in the slab file `path` has valid
    headers: what a restarted slab adapter would index (payloads are not checked here)."""
    data = memoryview(path.read_bytes())
    sb = fmt.parse_super(data[:4096])
    newest: dict[str, tuple[int, int]] = {}
    for slot in range(sb.slots):
        area = data[4096 + slot * sb.slot_bytes : 4096 + (slot + 1) * sb.slot_bytes]
        header = fmt.parse_slot(area, sb.file_id, slot)
        found = None if header is None else fmt.slot_blob(area, header)
        if header is None or found is None:
            continue
        if found[0] not in newest or newest[found[0]][0] < header.generation:
            newest[found[0]] = (header.generation, header.blob_len)
    return {key: size for key, (_, size) in newest.items()}


class PrivateRedis:
    """A redis-server of the test's own on a free port (never the shared one on 6379)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        cmd += ["--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with redis.Redis(port=self.port, socket_timeout=0.5) as r:
                    r.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
