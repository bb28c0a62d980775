"""The one error hierarchy of gpuwarden: everything we raise on purpose is a ``GpuwardenError``."""

from __future__ import annotations


class GpuwardenError(Exception):
    """Base of every error gpuwarden raises on purpose."""


class ConfigError(GpuwardenError):
    """Bad configuration or command-line input; the message says what and where."""


class ReportError(GpuwardenError):
    """A report that does not match the schema (the message names the field)."""


class CollectorFailure(GpuwardenError):
    """A collector could not read its source this round; reported in the report's ``errors``."""
