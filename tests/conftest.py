"""Shared fixtures: real server processes and shared-memory KV caches.

GPU tests (marker ``gpu``) skip without CUDA and CuPy, and fail instead when
``LMC_REQUIRE_GPU=1`` (set on the GPU machine, so a broken CUDA setup cannot pass as
skipped). Tests that run an outside command (marker ``needs_tool``) skip when it is
not installed, and fail instead under ``CI=true``: CI installs every such command
before pytest (.ci/run), so a missing one is a broken CI setup, not a skip.

Every :class:`ServerProcess` a test starts is returned by ``start()`` with its pool
prepared (``pool_ready_by_default``): a test that stores at once must not race the
preparing thread on a loaded machine; a test of start-up itself passes
``pool_ready=False``. A CPU- or null-backend one is forked from the test zygote
(``fork_from_zygote``, lmc_server/testing/forkserver.py): the real server entry point
in a process of its own, without importing the package again; the tests of how
``lmcache server`` starts run the command themselves.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from lmc_server.client import Client
from lmc_server.testing.process import ServerProcess
from lmc_server.testing.redis_process import RedisProcess
from lmc_server.testing.suite_order import DURATIONS_KEY, module_rank

ServerProcess.pool_ready_by_default = True
# CPU- and null-backend servers forked from a process that imported the package once
# (0.4 s of CPU saved per server, ~150 servers a run): lmc_server/testing/forkserver.py.
ServerProcess.fork_from_zygote = True


#: Seconds per test module in this run, for the next run's order
#: (lmc_server/testing/suite_order.py); kept by the controller, not the xdist workers.
_module_seconds: dict[str, float] = {}


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    name = report.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    _module_seconds[name] = _module_seconds.get(name, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    cache = getattr(session.config, "cache", None)
    if cache is None or _is_xdist_worker(session.config) or not _module_seconds:
        return
    if session.config.option.keyword:  # a -k run times part of a module
        return
    seconds = dict(cache.get(DURATIONS_KEY, {}))
    seconds.update({k: round(v, 2) for k, v in _module_seconds.items()})
    cache.set(DURATIONS_KEY, seconds)


def pytest_configure(config: pytest.Config) -> None:
    # xdist hands out modules with the most tests first unless told to keep the
    # collection order, which module_rank sets (--no-loadscope-reorder, made the
    # default here so the README's command stays as it is).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(optionalhook=True)  # an environment without xdist (tests/vllm's) has no such hook
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: two workers per core. Much of a worker's time is spent waiting on the
    servers, workers and commands it started (and on their timeouts), which use the
    cores meanwhile (2-core VM, the whole suite without a durations cache: 3 workers
    109 s, 4 workers 92-100 s, 5 workers 90-94 s; 4 keeps the margin with the least
    contention for the tests that time a server)."""
    return 2 * (os.cpu_count() or 1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cache = getattr(config, "cache", None)
    rank = module_rank(cache.get(DURATIONS_KEY, None) if cache is not None else None)
    items.sort(key=lambda i: rank.get(i.path.name, len(rank)))  # stable: in-module order kept
    gpu_items = [i for i in items if i.get_closest_marker("gpu")]
    if not gpu_items:
        return
    from lmc_server.transfer.select import cuda_available

    if cuda_available():
        return
    if os.environ.get("LMC_REQUIRE_GPU") == "1":
        raise pytest.UsageError("LMC_REQUIRE_GPU=1 but no usable CUDA device and CuPy")
    skip = pytest.mark.skip(reason="needs a CUDA GPU and CuPy")
    for item in gpu_items:
        item.add_marker(skip)


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs_tool"):
        command, install = mark.args
        if shutil.which(command) is not None:
            continue
        missing = f"{command} is not installed ({install})"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {missing}", pytrace=False)
        pytest.skip(missing)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """One CPU-backend server per test module: the harness's pool (0.25 GiB), separate
    object groups."""
    with ServerProcess(
        ["--chunk-size", "256", "--separate-object-groups", "--eviction-policy", "LRU"]
    ) as srv:
        yield srv


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.endpoint, timeout_s=30, client_name="pytest") as c:
        yield c


@pytest.fixture
def redis_proc() -> Iterator[RedisProcess]:
    """A redis-server of the test's own (free port, no persistence), stopped after it.
    A test that uses it carries ``needs_tool("redis-server", ...)``: skipped where
    redis-server is not installed, failed under ``CI=true``."""
    with RedisProcess() as r:
        yield r
