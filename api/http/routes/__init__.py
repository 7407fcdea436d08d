"""One router per resource; `ROUTERS` collects them for the app factory."""

from api.http.routes import audit, health, inventory, l2, metrics, pins, quotas, status, tenants, workers

ROUTERS = [
    health.router,
    status.router,
    metrics.router,
    l2.router,
    quotas.router,
    pins.router,
    tenants.router,
    inventory.router,
    workers.router,
    audit.router,
]
