"""The Grafana dashboard's queries name the connector's metrics and cover what operators watch.

Against a live server's ``/metrics``: ``tests/e2e/test_serve_vllm.py``.
"""

import pytest

from ecoffload.tools import dashboard


def test_names_come_from_selectors_not_from_labels_functions_or_variables():
    expr = (
        'sum by (engine, model_name) (rate(vllm:a_total{model_name=~"$model_name", x="b{c}"}'
        "[$__rate_interval])) / on(engine) group_left max(vllm:b) > bool 1e-9 "
        "unless absent(c_d) offset 5m"
    )
    assert dashboard.metric_names(expr) == {"vllm:a_total", "vllm:b", "c_d"}
    assert dashboard.metric_names('label_replace(up, "a", "$1", "b", "(.*)")') == {"up"}


def test_a_call_of_an_unknown_function_is_refused():
    with pytest.raises(dashboard.DashboardError, match="expected a PromQL function.*'sumx'"):
        dashboard.metric_names("sumx(rate(vllm:a_total[5m]))")


def test_a_variable_that_is_not_label_values_is_refused():
    board = {"templating": {"list": [{"name": "v", "type": "query", "query": "query_result(x)"}]}}
    with pytest.raises(dashboard.DashboardError, match="label_values"):
        list(dashboard.queries(board))


def test_every_query_selects_metrics_the_connector_defines():
    pytest.importorskip("vllm", reason="the metric definitions import vLLM")
    from ecoffload.connector import prometheus, stats

    defined = {prometheus.PREFIX + n + "_total" for n in stats.COUNTERS + stats.WORKER_COUNTERS}
    defined |= {prometheus.PREFIX + n for n in (*stats.GAUGES, prometheus.USAGE)}
    found = list(dashboard.queries(dashboard.load()))
    assert len(found) >= 20
    for where, query in found:
        names = dashboard.metric_names(query)
        assert names, f"{where} selects no metric: {query}"
        assert names <= defined, f"{where} selects {sorted(names - defined)}, not defined"


def test_the_dashboard_shows_what_the_issue_asks_operators_to_see():
    board = dashboard.load()
    shown = set().union(*(dashboard.metric_names(q) for _, q in dashboard.queries(board)))
    watched = {
        "hits_total", "misses_total",  # hit rate
        "bytes_saved_total", "bytes_loaded_total", "remote_bytes_pulled_total",  # bytes moved
        "arena_usage_perc", "items_resident", "bytes_resident",  # occupancy
        "arena_ready_fraction",  # readiness
        "evictions_total", "saves_skipped_no_room_total",
        "remote_items_pulled_total", "remote_pull_failures_total", "remote_fallbacks_total",
    }  # fmt: skip
    assert {"vllm:ecoffload_" + name for name in watched} <= shown
    titles = [p["title"] for p in board["panels"]]
    assert len(titles) == len(set(titles))  # each panel findable by its title
