"""The order tests/conftest.py runs the test modules in: longest first.

Under ``pytest -n auto --dist loadfile`` a long module that starts last runs alone while
the other workers idle; starting the longest ones first packs the run. Order only: a
stale entry costs nothing but a little packing.

The order comes from the durations of the last run, which conftest records in pytest's
cache under :data:`DURATIONS_KEY` (module file name -> seconds, all phases of all its
tests; written by the controller at the end of a run). A module without a cached
duration, every module in a checkout without a cache (CI), falls back to
:data:`LONGEST_FIRST`; tests/testing/test_conftest_order.py holds it to modules that exist
and holds test module file names unique across tests/' folders, the key being the name.
"""

from __future__ import annotations

from collections.abc import Mapping

#: The longest modules of a CI-like run on a 2-core machine, longest first.
LONGEST_FIRST = (
    "test_connector_runtime.py",
    "test_l2_redis.py",
    "test_l2_cluster.py",
    "test_soak.py",
    "test_chaos.py",
    "test_bench_ranks.py",
    "test_fuzz.py",
    "test_policies.py",
    "test_stateful.py",
    "test_bench_smoke.py",
    "test_hardening_input.py",
    "test_replay_traces.py",
    "test_kv_events.py",
)

#: pytest cache key: test module file name -> seconds of its last run.
DURATIONS_KEY = "lmc_server/module_seconds"


def module_rank(cached: Mapping[str, float] | None) -> dict[str, int]:
    """Module file name -> its place in the run, longest first.

    Modules with a cached duration rank by it; a :data:`LONGEST_FIRST` module without
    one (a cache written by a run of a few modules) comes before them, in the list's
    order. Modules in neither run last, in collection order."""
    cached = cached or {}
    names = [name for name in LONGEST_FIRST if name not in cached]
    names += sorted(cached, key=lambda name: -cached[name])
    return {name: i for i, name in enumerate(names)}
