"""KV events for routers (``--kv-events-endpoint``): what L1 and the disk tier hold, in
vLLM's wire format.

``publisher`` (the PUB socket, one batch per topic per loop iteration, the L1 watcher),
``sockets`` (socket options and CURVE for the event sockets), ``stage`` (a commit's
events and runs of removals), ``tiers`` (the disk tier's objects), ``replay`` (the
replay buffer and its ROUTER socket), ``settings`` (the publisher's view of the
configuration). Loaded only when events are on (``tests/project/test_layering.py``).
"""
