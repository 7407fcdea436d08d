"""Fleet-level pure logic: the directory's chunk index, scoring, sidecar registry and KV-event
stream tracker (wired by app/directory.py, served by api/directory/), and the reference router's
decisions (wired by app/route.py, served by api/route/). No I/O of its own."""
