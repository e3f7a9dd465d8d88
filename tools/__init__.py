"""What operators run: the ``ecoffload`` command and the Grafana dashboard.

The top layer: it reads the engine and the connector, nothing below imports it.
"""
