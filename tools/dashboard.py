"""The Grafana dashboard for ecoffload's ``vllm:ecoffload_*`` metrics, and its queries.

``grafana/ecoffload.json`` (shipped with the package; ``ecoffload dashboard``
prints it) is a dashboard to import into Grafana over a Prometheus that
scrapes vLLM's ``/metrics``: hit rate, bytes moved, arena occupancy and
readiness, evictions, saves skipped, pulls between hosts and their
fallbacks. Its variables: ``datasource`` (a Prometheus) and ``model_name``
(vLLM's label, from ``label_values``).

:func:`metric_names` reads the metric names a PromQL query selects, so a test
can check every query against what a live server exports (a renamed metric
would otherwise leave a panel silently empty).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grafana", "ecoffload.json")

# PromQL's aggregations, functions and keywords this parser accepts; any other
# name followed by "(" is refused (a typo would make a panel fail in Grafana).
FUNCTIONS = frozenset({
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "rate", "irate", "increase", "delta", "idelta", "deriv",
    "predict_linear", "histogram_quantile", "avg_over_time", "min_over_time",
    "max_over_time", "sum_over_time", "count_over_time", "last_over_time", "abs", "ceil",
    "floor", "round", "clamp", "clamp_min", "clamp_max", "sqrt", "exp", "ln",
    "label_replace", "label_join", "vector", "scalar", "time", "timestamp", "absent",
    "absent_over_time", "changes", "resets", "sort", "sort_desc",
})  # fmt: skip
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "by", "without", "on",
                      "ignoring", "group_left", "group_right"})  # fmt: skip
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"(?<![\w.:$])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*([^,)]+?)\s*(?:,[^)]*)?\)\s*$")


class DashboardError(ValueError):
    """A query the dashboard's checker cannot read."""


def load(path: str = PATH) -> dict[str, Any]:
    """The dashboard as a dict."""
    with open(path) as f:
        return json.load(f)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (Grafana variables allowed).

    Label matchers, range selectors, strings, label lists of ``by`` / ``on`` ...
    and Grafana's ``$variables`` are skipped; a name followed by ``(`` must be a
    known function or aggregation (else :class:`DashboardError`).
    """
    text = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers (inside them: labels, strings)
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges: [5m], [$__rate_interval]
    text = re.sub(r"\$\{?\w+\}?", "", text)  # Grafana variables outside those
    text = _LABEL_LISTS.sub("", text)
    names = set()
    for match in _NAME.finditer(text):
        name, call = match.group(1), match.group(2)
        if call:
            if name not in FUNCTIONS:
                raise DashboardError(
                    f"expected a PromQL function or aggregation before '(', found {name!r} "
                    f"in {expr!r}: fix the query or add the function to FUNCTIONS"
                )
        elif name not in KEYWORDS:
            names.add(name)
    return names


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every ``label_values`` variable."""
    for panel in dashboard.get("panels", []):
        for sub in [panel, *panel.get("panels", [])]:
            for target in sub.get("targets", []):
                yield f"panel {sub['title']!r} target {target['refId']}", target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable["query"]
        query = query["query"] if isinstance(query, dict) else query
        match = _LABEL_VALUES.match(query)
        if not match:
            raise DashboardError(
                f"expected variable {variable['name']!r} to be label_values(<metric>, <label>), "
                f"found {query!r}"
            )
        yield f"variable {variable['name']!r}", match.group(1)
