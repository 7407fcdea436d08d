"""OpenTelemetry traces of the sidecar's work, built from the event bus's START/END pairs (an
EventBus subscriber; wired by app/tracing.py only when `tracing.otlp_endpoint` is set)."""
