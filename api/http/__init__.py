"""The HTTP control plane (FastAPI): health, readiness, status, metrics and admin endpoints."""
