"""LMCacheMPConnector across server restarts under vLLM 0.33's own schedulers, on the
CPU backend (KV in shared memory), every page attention reads checked byte-exact.

Turn 1 stores; the server is then restarted between turns (SIGTERM), killed -9 and
started again, or killed and started again only after turn 2 arrived, with or without
vLLM's prefix cache reset at that moment. Turn 2 (turn 1's prompt and more) is stored
on the new server, chunks vLLM still held included; turn 3 hits them there. Under the
sync and the async scheduler; afterwards nothing of the engine or any server is left in
/dev/shm, also when the engine's process is killed -9 after registering with the
restarted server. Marker ``vllm``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sim_common import SERVER_ARGS, engine, prompt

from lmc_server.client import Client
from lmc_server.testing.server_restarts import HOW, RestartingServer

pytestmark = pytest.mark.vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


@pytest.fixture
def servers() -> Iterator[RestartingServer]:
    s = RestartingServer(SERVER_ARGS, l1_size_gb=0.5)
    try:
        yield s
    finally:
        s.close()


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("reset", [False, True], ids=["vllm-cache-kept", "vllm-cache-reset"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_turns_across_a_server_restart(
    servers: RestartingServer, tmp_model: Path, how: str, reset: bool, async_scheduling: bool
) -> None:
    e = engine(
        servers.current,
        tmp_model,
        "dsv41",
        async_scheduling=async_scheduling,
        load_failure_policy="recompute",
    )
    try:
        p = prompt(11, 1000)
        e.add("t1", p, max_tokens=2)
        e.run(["t1"])
        servers.restart(how)
        if reset:
            e.forget_local_cache()
        q = prompt(12, 300)
        e.add("t2", p + q, max_tokens=2)
        e.run(["t2"])
        assert "t2" not in e.loaded_tokens  # the new server held nothing
        e.forget_local_cache()
        e.add("t3", p + q + [4], max_tokens=1)
        e.run(["t3"])
        assert e.loaded_tokens == {"t3": 1280}, e.loaded_tokens
        assert not e.failed
        e.assert_no_wrong_bytes()
        with Client(servers.endpoint) as c:
            requests = c.stats().counters.requests
        assert requests.get("store:ok", 0) >= 1 and requests.get("retrieve:ok", 0) >= 1
    finally:
        e.close()
    servers.close()
    assert len(servers.pids) == 2
    mine = tuple(f"lmc-{pid}-" for pid in [os.getpid(), *servers.pids])
    assert [n for n in os.listdir("/dev/shm") if n.startswith(mine)] == []


ENGINE = """
import sys
from pathlib import Path
from sim_common import engine, prompt
from lmc_server.testing.process import ServerProcess

srv = ServerProcess(port=int(sys.argv[1]))
e = engine(srv, Path(sys.argv[2]), "dsv41", load_failure_policy="recompute")
p = prompt(21, 1000)
e.add("t1", p, max_tokens=2)
e.run(["t1"])
print("turn 1", flush=True)
sys.stdin.readline()  # the server restarts meanwhile
e.add("t2", p + prompt(22, 300), max_tokens=2)
e.run(["t2"])
assert not e.failed
print("turn 2", flush=True)
sys.stdin.readline()  # killed here
"""


def test_an_engine_killed_after_registering_again_leaves_nothing(
    servers: RestartingServer, tmp_model: Path
) -> None:
    """vLLM's process registers its KV with a server, again with the restarted one,
    and is killed -9: nothing of it is left in /dev/shm, and the server serves on."""
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE, str(servers.current.port), str(tmp_model)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])},
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "turn 1"
        servers.restart("killed")
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "turn 2"
        with Client(servers.endpoint) as c:
            assert c.stats().registrations >= 2  # scheduler and worker, registered again
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"lmc-{proc.pid}-")] == []
    with Client(servers.endpoint) as c:
        assert c.ping().server_version
