"""Errors the runtime raises for bad configs and bad batches."""

from __future__ import annotations


class ConfigError(ValueError):
    """A Config value is out of range or violates a check of buffers.yaml."""


class BatchError(ValueError):
    """A scheduled batch cannot be prepared; the buffers are left exactly as they were."""
