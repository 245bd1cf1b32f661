"""Eviction policies over a partition's object slots.

``base`` (the interface and the structures the policies share), ``names`` (the names and
one-line summaries, without numpy: the configuration reads them), one module per policy
(``lru``, the default; ``fifo``, ``arc``, ``s3fifo``, ``sarc``) and ``registry``
(``POLICIES``, ``make_policy``). Nothing is imported here, so reading ``names`` loads
no policy.
"""
