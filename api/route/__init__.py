"""`kvdepot route`: the HTTP side of the reference cache-aware router (fleet/router.py decides)."""
