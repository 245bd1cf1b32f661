"""Prometheus metrics and health over HTTP.

:mod:`.collector` turns the server's plain counters into metric families at scrape
time; :mod:`.endpoint` serves them (and ``/healthz``) from a thread; :mod:`.registry`
wires them (:func:`~lmc_server.metrics.registry.make_registry`) so that tests and tools
can scrape the same registry; :mod:`.buckets` holds the histogram bounds the server's
counters use. This file imports nothing: the server's counters import
:mod:`.buckets`, and only a server with ``--metrics-port`` loads prometheus_client.
"""
