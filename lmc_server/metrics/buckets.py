"""The transfer-duration histogram's bucket bounds, shared by the server's counters
(which bucket each transfer on the hot path) and the collector (which exports them).

A module of its own, without prometheus_client, so that the server's counters can
import it while a server without ``--metrics-port`` never loads Prometheus.
"""

#: Upper bounds (seconds) of the transfer-duration histogram buckets; a transfer's
#: ``buckets`` list has one count per bound plus one for ``+Inf``.
TRANSFER_BUCKETS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)
