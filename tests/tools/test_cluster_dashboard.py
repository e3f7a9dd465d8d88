"""tools/grafana: the cluster tier's panels show what issue 29 asks operators to see."""

from ecoffload.tools import dashboard


def test_the_dashboard_shows_the_cluster_tier():
    board = dashboard.load()
    shown = set().union(*(dashboard.metric_names(q) for _, q in dashboard.queries(board)))
    watched = {
        "cluster_hits_total", "cluster_misses_total", "cluster_bytes_fetched_total",
        "cluster_fetch_failures_total", "cluster_publishes_total", "cluster_publish_drops_total",
        "cluster_mac_failures_total", "cluster_available",
    }  # fmt: skip
    missing = {"vllm:ecoffload_" + name for name in watched} - shown
    assert not missing, f"no panel shows {sorted(missing)}"
