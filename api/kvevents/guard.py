"""Budgets of the KV-event sockets against a hostile local peer: which subscriptions the XPUB socket
applies, how often a refused request is logged, and how an ipc endpoint is bound private.

- `SubscriptionFilter`: the XPUB socket runs with `XPUB_MANUAL`, so a subscription costs state in
  libzmq only when the publisher applies it. Applied: a *broad* filter, a prefix of the fixed part
  of the topic (`kv@<host>@`, the text before `{model}`: `""`, `"kv@"`...; at most that many per
  connection, whatever a peer sends), and a *narrow* one, that fixed part followed by at most
  `MAX_MODEL_BYTES` bytes (one model's topic), while fewer than `cap` distinct narrow filters are
  held. Anything else is refused and counted. (libzmq itself still remembers every filter a
  connected peer sent until that peer leaves, so a peer past REFUSED_PER_PEER refused filters is
  disconnected: peers.py.) The socket's RCVHWM is small, so one connection cannot queue in libzmq
  much more than the publisher reads meanwhile.
- `Complaints` (app/complaints.py, re-exported here): counts every refusal and logs one line per
  `interval_s` at most, naming how many refusals it stands for (a flood of bad requests costs a
  counter, not a log line each).
- `bind_private(sock, endpoint)`: an ipc socket file created 0600 (under a umask, then chmod), so
  only the sidecar's user may connect; tcp endpoints bind as they are.

State: the filter's narrow-filter counts and counters. Event loop only.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from pathlib import Path

import zmq

from app.complaints import Complaints
from app.errors import ConfigError

__all__ = ["Complaints", "SubscriptionFilter", "bind_private", "ipc_path"]

#: bytes a narrow subscription may add to the topic's fixed part (a model name)
MAX_MODEL_BYTES = 512
#: the largest message the XPUB socket reads (a subscription: one flag byte and a filter)
MAX_SUBSCRIPTION_BYTES = 4096
#: the largest message the replay socket reads (a request frame is 8 bytes)
MAX_REQUEST_BYTES = 64
#: messages read per reader callback before the loop gets a turn (as the data plane's transport)
READ_BUDGET = 64
#: subscription messages read per callback (each is a few microseconds)
SUBSCRIPTION_BUDGET = 256
#: subscription messages a connection may have queued in libzmq: libzmq takes in at most about this
#: many per connection each time the socket is touched, fewer than the publisher reads meanwhile
SUBSCRIPTION_HWM = 64
#: refused filters after which a peer's connections are dropped (peers.py: libzmq keeps every
#: filter a connected peer sent, so this bounds what one peer holds there)
REFUSED_PER_PEER = 64


class SubscriptionFilter:
    def __init__(self, topic_template: str, host: str, cap: int) -> None:
        fixed = topic_template.replace("{host}", host)
        self.fixed = fixed.split("{model}", 1)[0].encode()
        self.cap = cap
        self.subscribers = 0
        """Subscriptions applied and not withdrawn."""
        self.refused = 0
        self._narrow: Counter[bytes] = Counter()

    def subscribe(self, topic: bytes) -> bool:
        """Whether to apply this subscription (counted either way)."""
        if self.fixed.startswith(topic):
            self.subscribers += 1
            return True
        if self._is_narrow(topic) and (topic in self._narrow or len(self._narrow) < self.cap):
            self._narrow[topic] += 1
            self.subscribers += 1
            return True
        self.refused += 1
        return False

    def unsubscribe(self, topic: bytes) -> bool:
        """Whether this withdraws a subscription that was applied."""
        if self.fixed.startswith(topic):
            self.subscribers = max(0, self.subscribers - 1)
            return True
        if topic in self._narrow:
            self._narrow[topic] -= 1
            if self._narrow[topic] <= 0:
                del self._narrow[topic]
            self.subscribers = max(0, self.subscribers - 1)
            return True
        return False

    def _is_narrow(self, topic: bytes) -> bool:
        return topic.startswith(self.fixed) and len(topic) - len(self.fixed) <= MAX_MODEL_BYTES


def bind_private(sock: zmq.Socket[bytes], endpoint: str, name: str) -> None:
    """Bind; an ipc socket file is created with mode 0600 (its directory 0700 when created here)."""
    path = ipc_path(endpoint)
    if path is not None:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    old = os.umask(0o177) if path is not None else None
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise ConfigError(f"{name}: cannot bind {endpoint}: {exc.strerror}") from None
    finally:
        if old is not None:
            os.umask(old)
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.chmod(path, 0o600)


def ipc_path(endpoint: str) -> Path | None:
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return None  # tcp, or an abstract socket (no file)
    return Path(endpoint[len("ipc://") :])
