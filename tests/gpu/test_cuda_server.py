"""The CUDA backend end to end: a real server process, workers in other processes.

Run on a GPU machine (``scripts/gpu-check.sh``); skipped elsewhere, failed when
``LMC_REQUIRE_GPU=1`` finds no GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lmc_server.client import Client, ServerError
from lmc_server.testing.process import ServerProcess

pytestmark = pytest.mark.gpu

WORKER = Path(__file__).with_name("cuda_worker.py")
SERVER_ARGS = ["--chunk-size", "256", "--separate-object-groups", "--eviction-policy", "LRU"]


def run_worker(args: dict, env: dict[str, str] | None = None, timeout_s: float = 180) -> str:
    p = subprocess.run(
        [sys.executable, str(WORKER), json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **(env or {})},
    )
    assert p.returncode == 0, f"worker failed:\n{p.stdout}\n{p.stderr}"
    return p.stdout


@pytest.fixture(scope="module", params=["staging", "dma"])
def cuda_server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """One server per explicit copy path (``auto`` picks one of them per request)."""
    args = SERVER_ARGS + ["--cuda-copy-mode", request.param]
    with ServerProcess(args, backend="cuda", l1_size_gb=2, start_timeout_s=60) as srv:
        srv.wait_pool_ready()  # stores right after start must not meet unpinned slabs
        try:
            yield srv
        finally:
            dest = os.environ.get("LMC_BENCH_OUT")
            if dest:  # the server's own account of the module's requests, for triage
                Path(dest, f"server-{request.param}.log").write_text(srv.log())


def device_count() -> int:
    import torch

    return int(torch.cuda.device_count())


@pytest.mark.parametrize("placement", ["layer", "block"])
@pytest.mark.parametrize("stride_pad", [0, 72])
def test_roundtrip_dsv41_all_groups(
    cuda_server: ServerProcess, stride_pad: int, placement: str
) -> None:
    """Byte-exact store and retrieve into other blocks, ordered by the worker's event.
    Each case stores its own digests: the same digests from another placement would be
    (rightly) served from the objects the earlier case stored."""
    out = run_worker(
        {
            "mode": "roundtrip",
            "endpoint": cuda_server.endpoint,
            "chunks": 4,
            "num_blocks": 96,
            "layers": 8,
            "stride_pad": stride_pad,
            "seed": 2 * stride_pad + (placement == "block"),
            "placement": placement,
        }
    )
    assert "ROUNDTRIP OK" in out


@pytest.mark.parametrize(
    ("model", "placement"),
    [("llama-flash-attn", "layer"), ("llama-flashinfer", "layer"), ("llama-flash-attn", "block")],
)
def test_roundtrip_llama(cuda_server: ServerProcess, model: str, placement: str) -> None:
    """The Llama-like preset as vLLM lays it out (a KV tensor per layer, each its own
    buffer; FlashAttention's K and V planes or FlashInfer's blocks), byte-exact through
    the server in both copy paths, retrieved into other blocks with a hole."""
    out = run_worker(
        {
            "mode": "roundtrip",
            "endpoint": cuda_server.endpoint,
            "chunks": 4,
            "num_blocks": 160,
            "layers": 4,
            "seed": 30
            + ["llama-flash-attn", "llama-flashinfer"].index(model)
            + 2 * (placement == "block"),
            "model": model,
            "placement": placement,
        }
    )
    assert "ROUNDTRIP OK" in out


def test_roundtrip_full_batch(cuda_server: ServerProcess) -> None:
    """A 64-chunk batch of the full 44-layer preset, laid out as vLLM does."""
    out = run_worker(
        {
            "mode": "roundtrip",
            "endpoint": cuda_server.endpoint,
            "chunks": 64,
            "num_blocks": 1100,
            "layers": 44,
            "seed": 9,
            "placement": "block",
        },
        timeout_s=300,
    )
    assert "ROUNDTRIP OK" in out


@pytest.mark.parametrize("mode", ["auto", "staging:256"])
def test_roundtrip_other_copy_modes(mode: str) -> None:
    """The default mode and staging sized to a whole request, through a real server:
    byte-exact for a 64-chunk batch of the full preset and a small padded one."""
    name, _, staging_mb = mode.partition(":")
    args = SERVER_ARGS + ["--cuda-copy-mode", name]
    if staging_mb:
        args += ["--cuda-staging-mb", staging_mb]
    with ServerProcess(args, backend="cuda", l1_size_gb=2, start_timeout_s=60) as srv:
        srv.wait_pool_ready()
        out = run_worker(
            {
                "mode": "roundtrip",
                "endpoint": srv.endpoint,
                "chunks": 64,
                "num_blocks": 1100,
                "layers": 44,
                "seed": 5,
            },
            timeout_s=300,
        )
        assert "ROUNDTRIP OK" in out
        out = run_worker(
            {
                "mode": "roundtrip",
                "endpoint": srv.endpoint,
                "chunks": 4,
                "num_blocks": 96,
                "layers": 8,
                "stride_pad": 72,
                "seed": 6,
            }
        )
        assert "ROUNDTRIP OK" in out


def test_server_benchmark(cuda_server: ServerProcess) -> None:
    """Wall time of the client's store/retrieve through a real server (what a worker
    sees), 1/16/64 chunks; reported in ``$LMC_BENCH_OUT/server.json``, not asserted."""
    out = run_worker(
        {
            "mode": "bench",
            "endpoint": cuda_server.endpoint,
            "num_blocks": 1100,
            "layers": 44,
            "seed": 3,
        },
        timeout_s=300,
    )
    line = next(x for x in out.splitlines() if x.startswith("BENCH "))
    results = json.loads(line[len("BENCH ") :])
    dest = os.environ.get("LMC_BENCH_OUT")
    if dest:
        Path(dest, "server.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    assert sorted(results, key=int) == ["1", "16", "64"]


def test_sm100_records_refused_on_sm90_device(cuda_server: ServerProcess) -> None:
    """The arch is the registering device's: 528-byte records from an H200 are refused."""
    import torch

    from lmc_server.testing.cuda_kv import CudaKV, device_arch
    from lmc_server.testing.presets import dsv41_flash

    if device_arch(0) == "sm100":
        pytest.skip("this GPU is SM100")
    with (
        CudaKV(dsv41_flash(arch="sm100", num_blocks=8, layers=2), 0) as kv,
        Client(cuda_server.endpoint, timeout_s=30) as c,
    ):
        with pytest.raises(ServerError) as e:
            c.register(**kv.register_kwargs())
        assert e.value.code == "arch"
        torch.cuda.synchronize()


def test_out_of_range_block_refused(cuda_server: ServerProcess) -> None:
    from lmc_server.testing.cuda_kv import CudaKV
    from lmc_server.testing.kv import block_ids_for
    from lmc_server.testing.presets import dsv41_flash

    geo = dsv41_flash(num_blocks=32, layers=4)
    with CudaKV(geo, 0) as kv, Client(cuda_server.endpoint, timeout_s=30) as c:
        reg = c.register(**kv.register_kwargs(model="oob/model"))
        ids = block_ids_for(reg, 1, None)
        ids["indexer"] = np.asarray(ids["indexer"]).copy()
        ids["indexer"][-1] = 32
        digest = os.urandom(32)
        with pytest.raises(ServerError) as e:
            c.store(reg, digest, ids)
        assert e.value.code == "bounds"
        assert c.lookup(reg, digest, lease=False).hit_chunks == 0
        assert c.ping().ready


def test_worker_on_gpu1_with_other_numbering() -> None:
    """Worker sees only GPU 1 (as its device 0); the server sees both, in another order."""
    if device_count() < 2:
        pytest.skip("needs two GPUs (device kind nvidia-h200-x2)")
    with ServerProcess(
        SERVER_ARGS,
        backend="cuda",
        l1_size_gb=1,
        start_timeout_s=60,
        env={"CUDA_VISIBLE_DEVICES": "1,0"},
    ) as srv:
        out = run_worker(
            {
                "mode": "roundtrip",
                "endpoint": srv.endpoint,
                "chunks": 4,
                "num_blocks": 96,
                "layers": 8,
                "seed": 11,
            },
            env={"CUDA_VISIBLE_DEVICES": "1"},
        )
        assert "ROUNDTRIP OK" in out
        assert "cuda device 0 of this server" in srv.log()


def test_answers_at_once_with_a_large_pool() -> None:
    """Pinning runs slab by slab in the background; ping answers long before it ends."""
    t0 = time.monotonic()
    with ServerProcess(
        SERVER_ARGS, backend="cuda", l1_size_gb=16, start_timeout_s=60, pool_ready=False
    ) as srv:
        first_ping_s = time.monotonic() - t0
        with Client(srv.endpoint, timeout_s=30) as c:
            deadline = time.monotonic() + 60
            while not c.ping().ready and time.monotonic() < deadline:
                time.sleep(0.01)
            ready_s = time.monotonic() - t0
            pool = c.stats().l1
        print(
            f"first ping {first_ping_s:.2f} s, first slab {ready_s:.2f} s, "
            f"ready slabs {pool.ready_slabs} of {pool.slabs}"
        )
        assert first_ping_s < 5.0
        assert pool.ready_slabs < pool.slabs  # still pinning in the background


def _free_bytes(device: int = 0) -> int:
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def test_worker_killed_mid_store(cuda_server: ServerProcess) -> None:
    """kill -9 a worker while its stores are being copied.

    The worker keeps two 64-chunk stores in flight (a copy is running most of the
    time) and is killed at an arbitrary moment. Within 5 s its registration is gone and
    its GPU memory is back (the server closed the IPC mapping); no object stays
    half-written; every chunk the server reports as stored holds exactly the worker's
    bytes (checked by another process); and the server serves everyone else.
    """
    from lmc_server.testing.cuda_kv import device_arch
    from lmc_server.testing.presets import dsv41_flash

    n, layers, blocks, seed = 64, 44, 1100, 11
    geo = dsv41_flash(arch=device_arch(0), num_blocks=blocks, layers=layers)
    kv_bytes = sum(geo.buffer_sizes)
    common = {
        "endpoint": cuda_server.endpoint,
        "chunks": n,
        "num_blocks": blocks,
        "layers": layers,
        "seed": seed,
    }
    _free_bytes()
    time.sleep(0.5)
    baseline = _free_bytes()
    with Client(cuda_server.endpoint, timeout_s=30, client_name="observer") as obs:
        regs_before = obs.stats().registrations
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), json.dumps({"mode": "store-until-killed", **common})],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("IDS "), line
            ids = json.loads(line[4:])
            line = proc.stdout.readline()
            assert "STORING" in line, line
            time.sleep(0.4)
            assert _free_bytes() < baseline - kv_bytes // 2
            assert obs.stats().registrations == regs_before + 1
        finally:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        t_kill = time.monotonic()
        reaped = released = False
        while time.monotonic() < t_kill + 5 and not (reaped and released):
            reaped = obs.stats().registrations == regs_before
            released = _free_bytes() > baseline - (256 << 20)
            time.sleep(0.05)
        waited = time.monotonic() - t_kill
        stats = obs.stats()
    assert reaped, "the dead worker's registration was not dropped within 5 s"
    assert released, "the dead worker's GPU memory was not released within 5 s (mapping kept)"
    assert all(p.writing == 0 for p in stats.partitions), stats.partitions
    assert stats.l1.used_bytes == sum(p.objects * p.object_bytes for p in stats.partitions)
    out = run_worker({"mode": "verify-kill", "ids": ids, **common}, timeout_s=300)
    verified = json.loads(out.split("VERIFIED ", 1)[1].splitlines()[0])
    assert verified["visible"], "no store completed before the kill: nothing was checked"
    aborted = "registration closed during the copy" in cuda_server.log()
    print(
        f"reaped and released {waited:.2f} s after the kill; {len(verified['visible'])} "
        f"stores visible and byte-exact; a store cut by the kill was aborted: {aborted}"
    )
    out = run_worker(
        {
            "mode": "roundtrip",
            "endpoint": cuda_server.endpoint,
            "chunks": 2,
            "num_blocks": 96,
            "layers": 8,
            "seed": 4,
        }
    )
    assert "ROUNDTRIP OK" in out
