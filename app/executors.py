"""Executors: the sidecar's named, bounded thread pools, made at build and shut down at close.

Blocking work never runs on the event loop nor in the default executor: each kind goes to its own
pool, passed to the components that need it (threads start on first use).
  codec (2)      checksums over whole chunks and copies of loaded blobs into the arena (L2)
  transfer (2)   waits on copy completion, and the making of the copies' machinery (app/planes.py)
  scrub (1)      a segment an engine instance left is zeroed here (engine/l1/domains.py)
  state (1)      the state files' writes (fsync: quotas, pins, purges), one at a time

State: the four pools. Made and closed on the event loop's thread (Service.build / Service.close).
`close()` waits for the running work: pending codec, transfer and scrub work is cancelled (the
scrubber's memset ends before the arena is unmapped); pending state writes complete.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


class Executors:
    def __init__(self) -> None:
        self.codec = ThreadPoolExecutor(2, thread_name_prefix="kvdepot-codec")
        self.transfer = ThreadPoolExecutor(2, thread_name_prefix="kvdepot-transfer")
        self.scrub = ThreadPoolExecutor(1, thread_name_prefix="kvdepot-scrub")
        self.state = ThreadPoolExecutor(1, thread_name_prefix="kvdepot-state")

    def close(self) -> None:
        for executor in (self.codec, self.transfer, self.scrub):
            executor.shutdown(wait=True, cancel_futures=True)
        self.state.shutdown(wait=True)
