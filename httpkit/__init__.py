"""The HTTP toolkit every kvdepot server shares: the sidecar's control plane (api/http), the
directory's and the router's apps (fleet/http), and their listeners (app/serving.py).

connections.py  client connections: header and body deadlines, a connection cap (uvicorn's h11)
guard.py        RequestGuard (body cap and deadline, mutations without the token refused unread),
                bearer_ok / admin_ok (the token checks)
errors.py       kvdepot's error classes -> HTTP statuses and the `{"error": {"code", "message"}}` body
docs.py         /docs and /redoc served with their own assets (no CDN)

Neutral ground: it imports nothing of kvdepot but app's error vocabulary (tests/check_layering.py),
so that the fleet uses it without importing the sidecar's api/, and the sidecar without the fleet.
"""
