"""The fleet directory's pure logic: the chunk index, scoring, the sidecar registry and the
KV-event stream tracker. Wired by app/directory.py; served by api/directory/."""
