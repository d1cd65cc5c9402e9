"""Aggregation rules (hub.yaml `aggregation.rule`): one module per rule behind one interface (base.py).

Importing this package registers today's rules, in the order hub.yaml's error message lists them. A new rule is a
class with @register("name") in its own module, added to BUILT_IN below (base.py says what a rule declares).
"""

import importlib

from silo_server.rules.base import (
    RULES,
    AggregationRefused,
    AggregationRule,
    Group,
    GroupResult,
    get_rule,
    register,
)

BUILT_IN = ("mean", "trimmed_mean", "median", "krum", "multi_krum", "fltrust")
for _module in BUILT_IN:
    importlib.import_module(f"silo_server.rules.{_module}")  # each registers its rule

__all__ = ["BUILT_IN", "RULES", "AggregationRefused", "AggregationRule", "Group", "GroupResult", "get_rule",
           "register"]
