"""What the router's outbound calls share: the relay of requests (fleet/http/proxy.py) and its own
calls to the engines and the directory (fleet/http/upstream.py) are both built on one `RouterCalls`.

State: references only (the settings, the one shared httpx client, the engines' state, the
metrics), set once; the subclasses hold the rest. Touched only by the router's event loop.

Primitives: RouterCalls(settings, client, engines, metrics), the base of Proxy and Upstream.
"""

from __future__ import annotations

import httpx

from fleet.http.router_metrics import RouterMetrics
from fleet.router import Engines
from fleet.router_config import RouterSettings

__all__ = ["RouterCalls"]


class RouterCalls:
    def __init__(
        self, settings: RouterSettings, client: httpx.AsyncClient, engines: Engines, metrics: RouterMetrics
    ) -> None:
        self.settings = settings
        self.client = client
        self.engines = engines
        self.metrics = metrics
