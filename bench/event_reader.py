"""EventReader: a subscriber of a sidecar's KV events in a thread of the benchmark's process
(`kvdepot bench server --kv-events-endpoint`): what a router that keeps up would read."""

from __future__ import annotations

import threading

import zmq


class EventReader:
    """A subscriber of the sidecar's KV events in a thread of this process: reads every batch (a
    consumer that keeps up, as a router does) and counts batches and bytes."""

    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self.batches = 0
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="kv-events-reader", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(100):
                frames = self._sub.recv_multipart()
                self.batches += 1
                self.bytes += sum(len(f) for f in frames)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        self._sub.close(0)
        self._ctx.term()
        return {"batches_read": self.batches, "bytes_read": self.bytes}
