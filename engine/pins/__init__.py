"""Prefix pins: what pins hold per tier (table.py), the service behind /pins (service.py), settings."""
