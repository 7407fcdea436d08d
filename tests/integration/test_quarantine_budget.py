"""The quarantine's budget with real processes: writers of several engine instances that reserve
all they can and stall (SIGSTOP) past their write lease never quarantine more than
`l1.quarantine_total_max_bytes`, each instance no more than `l1.quarantine_max_bytes`, so another
tenant's committed chunks keep being served."""

from __future__ import annotations

import os
import signal
import subprocess

from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import chunk_data, client, request_tokens
from tests.integration.test_fencing import CHUNK_BYTES, FENCE_ENV, writer
from tests.integration.waiting import wait_for

CHUNKS = 32  # l1_size_gb=2/1024 at 64 KiB per chunk


def test_stalled_writers_of_two_instances_leave_other_tenants_their_hits(
    sidecar_factory: StartSidecar,
) -> None:
    sc = sidecar_factory(env=FENCE_ENV, l1_size_gb=2 / 1024)  # caps left to their defaults: 1/2, 3/4
    victim = client(sc.url)
    stalled: list[subprocess.Popen[str]] = []
    try:
        toks = request_tokens(40, 8)
        stored = victim.store(toks, [chunk_data(40, i) for i in range(8)], request_id="w", cache_salt="v")
        assert stored.stored == 8
        reserved = []
        for seed in (41, 42):  # two engine instances, each asking for half of L1
            proc, offsets = writer(sc.url, CHUNKS // 2, seed)
            stalled.append(proc)
            os.kill(proc.pid, signal.SIGSTOP)
            reserved.append(len(offsets))
        wait_for(lambda: sc.get_json("/status")["l1"]["quarantined_objects"] == sum(reserved), timeout=30)
        assert victim.lookup(toks, request_id="r", cache_salt="v").hit_chunks == 8
        l1 = sc.get_json("/status")["l1"]
        assert reserved == [16, 8]  # the second instance gets what is left of the 3/4 in all
        assert l1["quarantined_bytes"] == 24 * CHUNK_BYTES <= CHUNKS * CHUNK_BYTES * 3 // 4
        assert victim.end_request("r") == 8
    finally:
        for proc in stalled:
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()
        victim.close()
