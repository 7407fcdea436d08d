"""The fleet's edge (as api/ is the sidecar's): the directory's and the router's HTTP apps, and the
directory's subscriptions to its sidecars (their KV events over ZMQ, their inventories over HTTP).
Parse, check, call fleet/'s pure logic, answer; built and run by fleet/wiring.

directory_app.py      the directory's API (FastAPI): registration, /v1/score, /v1/match, listing
subscriptions.py      one task per sidecar keeping the index equal to its holdings (events, replay,
                      inventory resyncs)
intake.py             the received event messages waiting to be applied, bounded in bytes
directory_metrics.py  the directory's Prometheus collector
router_app.py         the router's app (Starlette): OpenAI-compatible endpoints in front of engines
proxy.py              relays a request to the chosen engine, with retries
upstream.py           the router's calls to the directory (/v1/score) and the engines (/tokenize)
router_metrics.py     the router's metrics
"""
