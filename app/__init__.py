"""kvdepot application layer: settings, errors, logging, supervision and wiring."""

__version__ = "0.1.0"
