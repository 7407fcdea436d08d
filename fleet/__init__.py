"""The fleet wing: the directory (`kvdepot directory`: which sidecar holds which chunks) and the
reference router (`kvdepot route`: cache-aware, in front of the engines). Three layers, as in the
sidecar, arrows down only (tests/check_layering.py):

fleet/*.py    pure logic, no I/O of its own (as engine/ is the sidecar's):
              spec.py         what a sidecar registers (InstanceSpec) and the directory's settings
              credentials.py  a registered instance's credential (HMAC of its id)
              hashing.py      a request's chunk keys, as the sidecars compute them
              index.py        the chunk index: chunk -> the instances (and media) holding it
              registry.py     the sidecar registry: instances, liveness, bounds
              stream.py       one instance's event stream: sequence, incarnation, what to repair
              ingest.py       the ingest of events: KV-event batches and inventory lines -> index
              match.py        non-prefix matches (content at other offsets)
              score.py        /v1/score and /v1/match answers
              directory.py    Directory: the state one directory process shares (index, registry,
                              scorer, counters)
              router.py       the router's decision; router_config.py its settings; tokenize.py
                              what of a request it scores
fleet/http/   the edge (as api/ is the sidecar's): the directory's and the router's apps, the
              directory's subscriptions to its sidecars
fleet/wiring/ the processes (as app/ is the sidecar's): `kvdepot directory`, `kvdepot route`

The sidecar's own side of the fleet, registering it with a directory, is app/fleet_member.py: it
reads the sidecar's engine and settings, which the wing never imports.
"""
