"""The slab tier in real sidecar processes: SIGKILLed while writing behind (with its index
checkpointed all the while, so the checkpoint it leaves is stale), restarted: every chunk whose slot
was complete is served, byte-identical, and nothing else; damaged slots are misses. Attached,
resized and detached over HTTP while a client works; bad slab configs are refused with a message."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import xxhash

from storage.codec import blob_header
from storage.slab import headers as fmt
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import chunk_data, client, request_tokens
from tests.integration.l2_helpers import request_keys
from tests.integration.test_l2_crash import CHUNKS, SEEDS, served
from tests.integration.test_l2_reconfig import TOKEN, Workload
from tests.integration.test_serve_process import assert_refused, run_serve

ROOT = Path(__file__).resolve().parents[2]  # the sidecar runs from here: this tree's code
SLOT = 68 << 10  # a 64 KiB chunk and 4 KiB of headers
SLAB = {"type": "slab", "name": "slab", "slot_bytes": SLOT, "size_bytes": 4096 + 400 * SLOT}
ENV = {
    "KVDEPOT_L1__CHUNK_SIZE": "16",
    "KVDEPOT_L2__ADAPTERS": json.dumps([SLAB | {"fsync": "always", "checkpoint_s": 0.001}]),
    "KVDEPOT_L2__PREFETCH_DEADLINE_MS": "5000",
}


def complete_slots(path: Path) -> dict[str, tuple[int, int, int]]:
    """key -> (slot offset, payload offset in the slot, payload length) for every slot whose headers
    are valid and whose payload matches its checksum: what a reader may be served."""
    data = path.read_bytes()
    sb = fmt.parse_super(memoryview(data)[:4096])
    found: dict[str, tuple[int, int, int]] = {}
    for slot in range(sb.slots):
        at = 4096 + slot * sb.slot_bytes
        area = memoryview(data)[at : at + sb.slot_bytes]
        header = fmt.parse_slot(area, sb.file_id, slot)
        if header is None or (blob := fmt.slot_blob(area, header)) is None:
            continue
        start = fmt.payload_offset(header.blob_head_len)
        payload = area[start : start + header.payload_len]
        parsed = blob_header.read_header(blob[1])
        if xxhash.xxh3_128_digest(payload) == parsed.payload_checksum:
            found[blob[0]] = (at, start, header.payload_len)
    return found


def complete_prefix(keys: list[str], complete: dict[str, tuple[int, int, int]]) -> int:
    n = 0
    while n < len(keys) and keys[n] in complete:
        n += 1
    return n


def test_restart_after_sigkill_serves_complete_slots_and_never_torn_ones(
    sidecar_factory: StartSidecar, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    first = sidecar_factory(data_dir=data_dir, env=ENV, l1_size_gb=0.05)
    c = client(first.url)
    for n, seed in enumerate(SEEDS):
        toks = request_tokens(seed, CHUNKS)
        outcome = c.store(toks, [chunk_data(seed, i) for i in range(CHUNKS)], request_id=f"w{seed}")
        assert outcome.stored == CHUNKS
        if n == 2:  # three requests surely in their slots before the burst
            deadline = time.monotonic() + 60
            while first.get_json("/status")["l2"]["store"]["written"] < 3 * CHUNKS:
                assert time.monotonic() < deadline, "write-behind made no progress"
                time.sleep(0.01)
    c.close()
    first.kill()  # SIGKILL right after the burst: its writes are being worked through
    assert (data_dir / "l2-slab.index").is_file(), "the index was checkpointed while writing"

    slab = data_dir / "l2-slab"
    on_disk = complete_slots(slab)
    expected = {seed: complete_prefix(request_keys(seed, CHUNKS), on_disk) for seed in SEEDS}
    assert any(expected.values()), "nothing reached the slab before the kill"

    second = sidecar_factory(data_dir=data_dir, env=ENV, l1_size_gb=0.05)
    (adapter,) = second.get_json("/status")["l2"]["adapters"]
    assert adapter["type"] == "slab" and adapter["usage"]["objects"] >= len(on_disk)
    for seed in SEEDS:
        assert served(second.url, seed, f"r{seed}") == expected[seed]

    # Damage two slots of fully written requests: one flipped payload byte, one torn write (the
    # second half of the payload from another chunk).
    full = [seed for seed in SEEDS if expected[seed] == CHUNKS]
    assert len(full) >= 3, expected
    flip_seed, torn_seed = full[0], full[1]
    at, start, length = on_disk[request_keys(flip_seed, CHUNKS)[2]]
    other_at, other_start, _ = on_disk[request_keys(full[2], CHUNKS)[0]]
    with open(slab, "r+b") as f:
        f.seek(at + start + length - 100)
        byte = f.read(1)[0]
        f.seek(at + start + length - 100)
        f.write(bytes([byte ^ 0xFF]))
        f.seek(other_at + other_start + length // 2)
        tail = f.read(length - length // 2)
        at, start, _ = on_disk[request_keys(torn_seed, CHUNKS)[5]]
        f.seek(at + start + length // 2)
        f.write(tail)

    assert served(second.url, flip_seed, "flip") == 2
    assert served(second.url, torn_seed, "torn") == 5
    status = second.get_json("/status")["l2"]
    assert status["prefetch"]["integrity_failures"] >= 2

    # After one more restart the failed slots are gone (zeroed when deleted), the rest is served.
    second.stop()
    third = sidecar_factory(data_dir=data_dir, env=ENV, l1_size_gb=0.05)
    assert served(third.url, flip_seed, "flip2") == 2
    assert served(third.url, torn_seed, "torn2") == 5
    assert served(third.url, full[2], "whole") == CHUNKS


def test_attach_resize_and_detach_a_slab_under_load(sidecar_factory: StartSidecar, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    env = {
        "KVDEPOT_L1__CHUNK_SIZE": "16",
        "KVDEPOT_HTTP__ADMIN_TOKEN": TOKEN,
        "KVDEPOT_L2__ADAPTERS": json.dumps([{"type": "disk", "name": "disk"}]),
    }
    sc = sidecar_factory(data_dir=data_dir, env=env, l1_size_gb=0.01)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    data_dir.joinpath("foreign").write_bytes(b"not yours" * 50_000)
    slab = SLAB | {"paths": [str(data_dir / "slabs" / "a"), str(data_dir / "slabs" / "b")]}
    work = Workload(sc.url)
    work.start()
    try:
        with httpx.Client(base_url=sc.http, timeout=30) as http:
            for body, status, says in [
                (SLAB | {"slot_bytes": SLOT + 1}, 422, "multiple of 4096"),
                (SLAB | {"paths": [str(tmp_path / "far")]}, 422, "outside l2.allowed_roots"),
                (SLAB | {"paths": [str(data_dir / "foreign")]}, 422, "not a kvdepot slab"),
            ]:
                r = http.post("/l2/adapters", json=body, headers=auth)
                assert r.status_code == status, r.text
                assert says in r.json()["error"]["message"]
            assert data_dir.joinpath("foreign").read_bytes() == b"not yours" * 50_000
            assert not (tmp_path / "far").exists()

            r = http.post("/l2/adapters", json=slab, headers=auth)
            assert r.status_code == 201, r.text
            assert r.json()["type"] == "slab"
            assert r.json()["usage"]["capacity_bytes"] == 2 * 400 * SLOT
            done_before = work.done
            while work.done < done_before + 5 and work.is_alive() and not work.failures:
                work.stop.wait(0.05)
            r = http.patch("/l2/adapters/slab", json={"capacity_gb": 10 * SLOT / (1 << 30)}, headers=auth)
            usage = r.json()["usage"]
            assert usage["capacity_bytes"] == 10 * SLOT and usage["objects"] <= 10
            assert http.delete("/l2/adapters/disk?mode=drain", headers=auth).status_code == 204
            done_before = work.done
            while work.done < done_before + 5 and work.is_alive() and not work.failures:
                work.stop.wait(0.05)
            (adapter,) = http.get("/l2/adapters").json()["adapters"]
            assert adapter["name"] == "slab" and adapter["health"]["state"] == "ok"
            assert adapter["stats"]["stores"] > 0 and adapter["stats"]["evictions"] > 0
            assert http.delete("/l2/adapters/slab?mode=drain", headers=auth).status_code == 204
    finally:
        work.stop.set()
        work.join(30)
    assert work.failures == []
    assert (data_dir / "slabs" / "a").stat().st_size == 4096 + 400 * SLOT
    assert (data_dir / "l2-slab.index").is_file(), "detaching checkpoints the index"


def test_a_foreign_or_wrongly_sized_slab_stops_the_start_with_one_line(
    sidecar_factory: StartSidecar, tmp_path: Path
) -> None:
    data_dir = tmp_path / "d"
    data_dir.mkdir()
    foreign = data_dir / "precious"
    foreign.write_bytes(b"precious" * 100_000)
    config = tmp_path / "kvdepot.toml"
    config.write_text(
        f'[[l2.adapters]]\ntype = "slab"\nname = "s"\npaths = ["{foreign}"]\n'
        f"slot_bytes = {SLOT}\nsize_bytes = {4096 + 40 * SLOT}\n"
    )
    args = ("--config", str(config), "--data-dir", str(data_dir), "--http-port", "0", "--l1-size-gb", "0.01")
    line = assert_refused(run_serve(ROOT, *args), "l2.adapters[s]", str(foreign), "not a kvdepot slab")
    assert "refusing to overwrite" in line
    assert foreign.read_bytes() == b"precious" * 100_000

    foreign.unlink()
    config.write_text(config.read_text().replace(str(foreign), str(data_dir / "slab")))
    sidecar_factory("--config", str(config), data_dir=data_dir, l1_size_gb=0.01).stop()  # creates it
    assert (data_dir / "slab").stat().st_size == 4096 + 40 * SLOT
    config.write_text(config.read_text().replace(f"size_bytes = {4096 + 40 * SLOT}", "size_bytes = 8192000"))
    assert_refused(run_serve(ROOT, *args), "l2.adapters[s]", "size_bytes says 8192000")
    config.write_text(
        config.read_text().replace(f'paths = ["{data_dir / "slab"}"]', f'paths = ["{tmp_path}/far"]')
    )
    assert_refused(run_serve(ROOT, *args), "l2.adapters[s]", "l2.allowed_roots")
    assert not (tmp_path / "far").exists()
