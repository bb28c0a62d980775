"""Rules as data: YAML rule files parsed into typed rules, evaluated per node into findings.

``load_rules`` reads and validates rule files (``default_rules_dir()`` holds the shipped ones,
documented in ``rules/README.md``); ``RuleEngine`` evaluates them on each report's ``NodeView``.
"""

from __future__ import annotations

from aggregator.rules.engine import RuleEngine, Series
from aggregator.rules.model import (
    ErrorRule,
    EventRule,
    FieldRule,
    GpuMissingRule,
    RateRule,
    Rule,
    RuleError,
    ShareRule,
    default_rules_dir,
    load_rules,
)

__all__ = [
    "ErrorRule",
    "EventRule",
    "FieldRule",
    "GpuMissingRule",
    "RateRule",
    "Rule",
    "RuleEngine",
    "RuleError",
    "Series",
    "ShareRule",
    "default_rules_dir",
    "load_rules",
]
