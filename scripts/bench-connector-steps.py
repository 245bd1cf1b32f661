"""What LMCacheMPConnector costs under vLLM 0.33's own scheduler: added steps and
scheduler-thread time.

Run with the vLLM environment (docs/vllm.md), from the repository root:

    /work/vllm-venv/bin/python scripts/bench-connector-steps.py [--waiting 1,16,256]

For each scheduler (``Scheduler``, ``AsyncScheduler``), case (``miss``: nothing cached;
``hit``: every prompt's 2 whole chunks cached on the server, vLLM's own prefix cache
empty) and number of requests arriving at once, it runs ``tests/vllm/engine_sim.py``
(vLLM's scheduler and KV cache manager, both connector sides, a real server process on
the CPU engine, a simulated forward pass of ``--forward-ms`` and, for a step without
tokens, ``--idle-step-ms`` of waiting, the round trip to the workers; without it the
simulation's idle steps spin in Python and starve the link's thread of the GIL) and
reports:

* added steps (and milliseconds): per request, the steps from its arrival to its
  first scheduled tokens, minus the same for the same requests with loads off (the
  connector looks nothing up: a miss without lookups, a hit recomputed), mean and max;
* connector time per step: the time the scheduler thread spent in the scheduler-side
  connector's hooks (``on_new_request``, ``get_num_new_matched_tokens``,
  ``update_state_after_alloc``, ``build_connector_meta``, ``update_connector_output``,
  ``request_finished``), wall (waits for lookup answers included) and CPU time of
  the thread, mean and max over the steps until every request was scheduled, and
  apart the CPU time of the step the requests arrive before (their ``on_new_request``
  calls, the lookup batch, the first questions), median and max over the rounds, and
  per hook (median, in the JSON); of it, the CPU time of the garbage collector's
  passes that ran inside the hooks (:class:`HookTimer`), and the same step's CPU
  time with loads off (the hooks are called and look nothing up: the floor of the
  calls and of this timing); and both less the timer's own cost (``less timer``):
  reading a thread's CPU clock is a system call (about 2 us on the 2-core VM), so each
  timed hook call carries about one of them; :meth:`HookTimer.calibrate` measures what
  the timer reports for a hook that does nothing, and that times the step's hook calls
  is subtracted. The loads-off step has fewer hook calls than a hit's (vLLM asks again
  about every request whose answer is not in yet), so the difference of the two
  uncorrected figures overstates the connector's cost.

Prompts are 700 tokens (2 whole 256-token chunks and a tail), one generated token. The
heap is frozen once the engine is built, as vLLM's ``EngineCore`` does.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "vllm"))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

SERVER_ARGS = ["--chunk-size", "256", "--separate-object-groups", "--eviction-policy", "LRU"]
HOOKS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
)


def prompt(seed: int, n: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 31) % 20000 for i in range(n)]


class HookTimer:
    """Wraps the scheduler-side connector's hooks; sums their time per engine step.

    Apart, the CPU time of the cyclic garbage collector's passes that ran inside a hook
    on this thread: a pass runs in whichever code allocates when the allocation count
    crosses its threshold (in this heap, about 0.7 ms for the youngest generation and
    8 ms for the middle one), so it lands in a hook by chance, in proportion to what the
    hook allocates and what vLLM allocated before it."""

    def __init__(self, connector: Any) -> None:
        self.step_s: list[float] = []
        self.step_cpu_s: list[float] = []
        self.step_gc_cpu_s: list[float] = []
        #: per step, CPU seconds per hook
        self.step_hooks_cpu_s: list[dict[str, float]] = []
        self._now_s = 0.0
        self._cpu_s = 0.0
        self._gc_cpu_s = 0.0
        self._gc_from_s: float | None = None
        self._in_hook = False
        self._thread = threading.get_ident()
        self._hooks_cpu_s: dict[str, float] = {}
        #: per step, the hook calls timed
        self.step_calls: list[int] = []
        self._calls = 0
        #: CPU seconds the timer reports for a hook call that does nothing (calibrate)
        self.call_overhead_s = self.calibrate()
        for name in HOOKS:
            setattr(connector, name, self._wrap(getattr(connector, name)))
        gc.callbacks.append(self._on_gc)

    def calibrate(self, calls: int = 2000, batches: int = 9) -> float:
        """What one timed call of a hook that does nothing adds to a step's CPU time:
        the median over ``batches`` of ``calls`` calls each, timed as the hooks are."""

        def nothing() -> None:
            return None

        timed = self._wrap(nothing)
        per_call = []
        for _ in range(batches):
            before = self._cpu_s
            for _ in range(calls):
                timed()
            per_call.append((self._cpu_s - before) / calls)
        self._cpu_s, self._now_s, self._calls, self._hooks_cpu_s = 0.0, 0.0, 0, {}
        return statistics.median(per_call)

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if not self._in_hook or threading.get_ident() != self._thread:
            return
        if phase == "start":
            self._gc_from_s = time.thread_time()
        elif self._gc_from_s is not None:
            self._gc_cpu_s += time.thread_time() - self._gc_from_s
            self._gc_from_s = None

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        name = fn.__name__

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            self._in_hook = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._in_hook = False
                cpu_s = time.thread_time() - c0
                self._now_s += time.perf_counter() - t0
                self._cpu_s += cpu_s
                self._calls += 1
                self._hooks_cpu_s[name] = self._hooks_cpu_s.get(name, 0.0) + cpu_s

        return timed

    def end_step(self) -> None:
        self.step_s.append(self._now_s)
        self.step_cpu_s.append(self._cpu_s)
        self.step_gc_cpu_s.append(self._gc_cpu_s)
        self.step_hooks_cpu_s.append(self._hooks_cpu_s)
        self.step_calls.append(self._calls)
        self._now_s = self._cpu_s = self._gc_cpu_s = 0.0
        self._calls = 0
        self._hooks_cpu_s = {}


def run_case(
    port: int,
    tmp: Path,
    *,
    n: int,
    hit: bool,
    async_scheduling: bool,
    load: bool,
    forward_s: float,
    idle_step_s: float,
    seed: int,
    rounds: int,
    settings: dict[str, Any],
) -> dict[str, Any]:
    """``rounds`` times: ``n`` requests arrive at once (for a hit: their prompts stored
    and vLLM's own cache emptied first); step until every one was scheduled."""
    from engine_sim import SimEngine

    e = SimEngine(
        port,
        tmp,
        model="plain",
        num_blocks=max(600, n * 50),
        max_num_batched_tokens=8192,
        async_scheduling=async_scheduling,
        forward_s=forward_s,
        idle_step_s=idle_step_s,
        extra={"lmcache.mp.load": load, **settings},
    )
    # as EngineCore does once it is built (vllm/v1/engine/core.py): the start-up heap
    # frozen, so that a collection does not scan torch's and vLLM's objects inside
    # whichever hook happens to allocate (without it, single steps reach 100-350 ms)
    gc.collect()
    gc.freeze()
    out: dict[str, Any] = {
        "first_scheduled": {},
        "first_scheduled_s": {},
        "step_s": [],
        "step_cpu_s": [],
        "arrival_cpu_s": [],
        "arrival_gc_cpu_s": [],
        "arrival_wall_s": [],
        "arrival_hooks_cpu_s": [],
        "arrival_less_timer_cpu_s": [],
        "arrival_calls": [],
        "timer_call_overhead_s": 0.0,
        "loaded": 0,
        "failed": 0,
    }
    timer = None
    try:
        timer = HookTimer(e.connector)
        for k in range(rounds):
            prompts = {f"r{k}-{i}": prompt(seed + 1000 * k + i, 700) for i in range(n)}
            if hit:  # store the prompts first, then forget vLLM's own copy
                for rid, p in prompts.items():
                    e.add("w" + rid, p, max_tokens=1)
                e.run(["w" + r for r in prompts], max_steps=20000, timeout_s=600)
                e.forget_local_cache()
            e.step()  # idle: requests arrive between steps, as from EngineCore's queue
            timer.end_step()
            for rid, p in prompts.items():
                e.add(rid, p + [1], max_tokens=1)
            first = len(timer.step_s)
            while not set(prompts) <= set(e.first_scheduled_step):
                e.step()
                timer.end_step()
                assert len(timer.step_s) - first < 10000
            out["arrival_cpu_s"].append(timer.step_cpu_s[first])
            out["arrival_gc_cpu_s"].append(timer.step_gc_cpu_s[first])
            out["arrival_wall_s"].append(timer.step_s[first])
            out["arrival_hooks_cpu_s"].append(timer.step_hooks_cpu_s[first])
            out["arrival_calls"].append(timer.step_calls[first])
            out["arrival_less_timer_cpu_s"].append(
                timer.step_cpu_s[first] - timer.step_calls[first] * timer.call_overhead_s
            )
            out["timer_call_overhead_s"] = timer.call_overhead_s
            out["step_s"] += timer.step_s[first:]
            out["step_cpu_s"] += timer.step_cpu_s[first:]
            e.run(prompts, max_steps=20000, timeout_s=600)
            for r in prompts:
                out["first_scheduled"][r] = e.first_scheduled_step[r] - e.added_at_step[r]
                out["first_scheduled_s"][r] = e.first_scheduled_s[r] - e.added_at_s[r]
            out["loaded"] += sum(1 for r in prompts if e.loaded_tokens.get(r))
        out["failed"] = len(e.failed)
        return out
    finally:
        if timer is not None:
            timer.close()
        gc.unfreeze()
        e.close()


def main() -> int:
    from lmc_server.integration.settings import ConnectorSettings
    from lmc_server.testing.process import ServerProcess

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--waiting", default="1,16,256", help="requests arriving at once")
    ap.add_argument(
        "--forward-ms",
        type=float,
        default=5.0,
        help="simulated forward pass of a step that computes tokens",
    )
    ap.add_argument(
        "--idle-step-ms",
        type=float,
        default=0.5,
        help="a step without tokens (the round trip to the workers)",
    )
    ap.add_argument(
        "--lookup-wait-ms",
        type=float,
        default=1e3 * ConnectorSettings.lookup_wait_s,
        help="lmcache.mp.lookup_wait_s, in ms (default: the connector's)",
    )
    ap.add_argument(
        "--idle-load-wait-ms",
        type=float,
        default=1e3 * ConnectorSettings.idle_load_wait_s,
        help="lmcache.mp.idle_load_wait_s, in ms (default: the connector's)",
    )
    ap.add_argument("--rounds", type=int, default=5, help="rounds per case (medians)")
    ap.add_argument("--schedulers", default="sync,async")
    ap.add_argument("--cases", default="miss,hit")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-steps-"))
    rows = []
    seed = 1
    settings = {
        "lmcache.mp.lookup_wait_s": args.lookup_wait_ms / 1000,
        "lmcache.mp.idle_load_wait_s": args.idle_load_wait_ms / 1000,
    }
    for async_scheduling in [s == "async" for s in args.schedulers.split(",")]:
        for hit in [c == "hit" for c in args.cases.split(",")]:
            for n in [int(x) for x in args.waiting.split(",")]:
                res = {}
                for load in (True, False):
                    seed += 1000 * args.rounds
                    with ServerProcess(SERVER_ARGS, l1_size_gb=1.0) as srv:
                        res[load] = run_case(
                            srv.port,
                            tmp,
                            n=n,
                            hit=hit,
                            async_scheduling=async_scheduling,
                            load=load,
                            forward_s=args.forward_ms / 1000,
                            idle_step_s=args.idle_step_ms / 1000,
                            seed=seed,
                            rounds=args.rounds,
                            settings=settings,
                        )
                on, off = res[True], res[False]
                added = [
                    on["first_scheduled"][r] - off["first_scheduled"][r]
                    for r in on["first_scheduled"]
                ]
                added_ms = [
                    1e3 * (on["first_scheduled_s"][r] - off["first_scheduled_s"][r])
                    for r in on["first_scheduled_s"]
                ]
                steps, cpu = on["step_s"], on["step_cpu_s"]
                row = {
                    "scheduler": "async" if async_scheduling else "sync",
                    "case": "hit" if hit else "miss",
                    "waiting": n,
                    "added_steps_median": statistics.median(added),
                    "added_ms_median": statistics.median(added_ms),
                    "connector_cpu_ms_per_step_median": 1e3 * statistics.median(cpu),
                    "added_steps_mean": sum(added) / len(added),
                    "added_steps_max": max(added),
                    "added_ms_mean": sum(added_ms) / len(added_ms),
                    "added_ms_max": max(added_ms),
                    "connector_ms_per_step_mean": 1e3 * sum(steps) / len(steps),
                    "connector_ms_per_step_max": 1e3 * max(steps),
                    "connector_cpu_ms_per_step_mean": 1e3 * sum(cpu) / len(cpu),
                    "connector_cpu_ms_per_step_max": 1e3 * max(cpu),
                    "arrival_step_cpu_ms_median": 1e3 * statistics.median(on["arrival_cpu_s"]),
                    "arrival_step_cpu_ms_max": 1e3 * max(on["arrival_cpu_s"]),
                    "arrival_step_gc_cpu_ms_median": 1e3
                    * statistics.median(on["arrival_gc_cpu_s"]),
                    "arrival_step_cpu_less_gc_ms_median": 1e3
                    * statistics.median(
                        c - g
                        for c, g in zip(on["arrival_cpu_s"], on["arrival_gc_cpu_s"], strict=True)
                    ),
                    "arrival_step_wall_ms_median": 1e3 * statistics.median(on["arrival_wall_s"]),
                    "arrival_step_cpu_ms_loads_off_median": 1e3
                    * statistics.median(off["arrival_cpu_s"]),
                    "arrival_step_cpu_ms_less_timer_median": 1e3
                    * statistics.median(on["arrival_less_timer_cpu_s"]),
                    "arrival_step_cpu_ms_loads_off_less_timer_median": 1e3
                    * statistics.median(off["arrival_less_timer_cpu_s"]),
                    "arrival_step_hook_calls_median": statistics.median(on["arrival_calls"]),
                    "arrival_step_hook_calls_loads_off_median": statistics.median(
                        off["arrival_calls"]
                    ),
                    "timer_call_overhead_us": 1e6 * on["timer_call_overhead_s"],
                    "arrival_step_cpu_ms_by_hook_median": {
                        h: 1e3 * statistics.median(d.get(h, 0.0) for d in on["arrival_hooks_cpu_s"])
                        for h in HOOKS
                    },
                    "arrival_step_cpu_ms_less_timer_by_round": [
                        1e3 * c for c in on["arrival_less_timer_cpu_s"]
                    ],
                    "arrival_step_hook_calls_by_round": on["arrival_calls"],
                    "arrival_step_cpu_ms_by_hook_by_round": [
                        {h: 1e3 * c for h, c in d.items()} for d in on["arrival_hooks_cpu_s"]
                    ],
                    "steps": len(steps),
                    "loaded": on["loaded"],
                    "failed": on["failed"] + off["failed"],
                }
                rows.append(row)
                print(
                    f"{row['scheduler']:5} {row['case']:4} waiting {n:3}: added steps "
                    f"median {row['added_steps_median']:.1f} mean "
                    f"{row['added_steps_mean']:.2f} max {row['added_steps_max']} "
                    f"({row['added_ms_mean']:.1f} ms, max {row['added_ms_max']:.1f}); "
                    f"connector per step: wall mean "
                    f"{row['connector_ms_per_step_mean']:.3f} ms max "
                    f"{row['connector_ms_per_step_max']:.3f}, cpu median "
                    f"{row['connector_cpu_ms_per_step_median']:.3f} mean "
                    f"{row['connector_cpu_ms_per_step_mean']:.3f} max "
                    f"{row['connector_cpu_ms_per_step_max']:.3f}, the arrivals' step "
                    f"median {row['arrival_step_cpu_ms_median']:.3f} max "
                    f"{row['arrival_step_cpu_ms_max']:.3f} (collector "
                    f"{row['arrival_step_gc_cpu_ms_median']:.3f}, less collector "
                    f"{row['arrival_step_cpu_less_gc_ms_median']:.3f}, wall "
                    f"{row['arrival_step_wall_ms_median']:.3f}; loads off "
                    f"{row['arrival_step_cpu_ms_loads_off_median']:.3f}; less timer "
                    f"{row['arrival_step_cpu_ms_less_timer_median']:.3f}, loads off "
                    f"{row['arrival_step_cpu_ms_loads_off_less_timer_median']:.3f}: hook calls "
                    f"{row['arrival_step_hook_calls_median']:.0f} / "
                    f"{row['arrival_step_hook_calls_loads_off_median']:.0f} at "
                    f"{row['timer_call_overhead_us']:.2f} us), {row['steps']} steps; "
                    f"{row['loaded']} loaded, {row['failed']} failed",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
