"""The eviction policies' names and one-line summaries, without the policies.

What ``--eviction-policy`` accepts and what its ``--help`` says: the configuration (and
so every ``lmcache`` command, even one that only reports a usage error) reads these
without importing the policies, which need numpy (a fifth of a CLI call's CPU). Each
policy class takes its ``summary`` from here under its ``name``;
``tests/cache/test_eviction.py`` checks that :data:`~lmc_server.cache.eviction.registry.POLICIES`
names exactly these, in this order.
"""

from __future__ import annotations

#: name -> one line for ``--help``, in the order the help lists them.
SUMMARIES: dict[str, str] = {
    "LRU": "least recently used first (a lookup, retrieve or released lease is a use)",
    "FIFO": "first stored, first evicted; uses do not count",
    "ARC": "adaptive: balances once-used (recency) against re-used (frequency) objects",
    "S3FIFO": "small probationary FIFO + main FIFO + ghosts: one-time objects leave first",
    "SARC": (
        "ARC with a long-memory frequency sketch: prefixes that come back are kept "
        "over first-time ones"
    ),
}

#: ``--help`` text of ``--eviction-policy``: one line per policy (``\b`` keeps click
#: from re-wrapping them into one paragraph).
POLICY_HELP = "Eviction policy, one of:\n\n\b\n" + "\n".join(
    f"{name}: {summary}" for name, summary in SUMMARIES.items()
)
