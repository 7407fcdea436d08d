"""One router per resource; `ROUTERS` collects them for the app factory."""

from api.http.routes import health, metrics, status

ROUTERS = [health.router, status.router, metrics.router]
