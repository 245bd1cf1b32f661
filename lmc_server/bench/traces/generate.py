"""Synthetic request traces in the Mooncake format, so that no policy is tuned to one trace.

Each generator is deterministic for a seed and writes one JSON object per line
(``timestamp`` ms, ``input_length`` tokens, ``output_length``, ``hash_ids``: one id per
512-token block, equal ids = reusable prefix), which ``lmcache bench replay --trace``
reads like the real trace. Every ``input_length`` is a whole number of blocks, so every
block yields two full 256-token chunks.

- ``shared-prompts``: many users behind a few long system prompts (Zipf popularity)
  followed by a one-off user part, with a scan of long one-off documents mixed in. What
  pays: keeping the prompts; what hurts LRU: the scan flushes them.
- ``multi-turn``: chat sessions whose next prompt extends the previous one (history +
  answer + new message) after an exponential think time, many sessions interleaved,
  each behind one of a few system prompts. What pays: keeping live sessions' histories
  until their next turn; most of a finished session's history is never used again.

    python -m lmc_server.bench.traces.generate shared-prompts .bench/shared.jsonl
    python -m lmc_server.bench.traces.generate multi-turn .bench/multiturn.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class Record:
    timestamp_ms: int
    hash_ids: list[int]
    output_length: int = 64

    def to_json(self) -> str:
        return json.dumps(
            {
                "timestamp": self.timestamp_ms,
                "input_length": len(self.hash_ids) * BLOCK_TOKENS,
                "output_length": self.output_length,
                "hash_ids": self.hash_ids,
            }
        )


class _Ids:
    """Fresh block ids (never reused unless the caller keeps them)."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def shared_prompts(
    requests: int = 6000,
    seed: int = 1,
    prompts: int = 64,
    zipf_a: float = 1.0,
    scan_share: float = 0.3,
) -> Iterator[Record]:
    """Users behind ``prompts`` system prompts of 8-48 blocks (Zipf), a 1-6 block one-off
    part each; ``scan_share`` of the requests are one-off 16-64 block documents."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    system = [ids.take(int(rng.integers(8, 49))) for _ in range(prompts)]
    weights = 1.0 / np.arange(1, prompts + 1) ** zipf_a
    weights /= weights.sum()
    t = 0.0
    for _ in range(requests):
        t += rng.exponential(300.0)
        if rng.random() < scan_share:
            blocks = ids.take(int(rng.integers(16, 65)))
        else:
            p = int(rng.choice(prompts, p=weights))
            blocks = system[p] + ids.take(int(rng.integers(1, 7)))
        yield Record(int(t), blocks)


def multi_turn(
    requests: int = 6000,
    seed: int = 2,
    live_sessions: int = 150,
    prompts: int = 3,
    mean_turns: float = 6.0,
    mean_think_ms: float = 60_000.0,
) -> Iterator[Record]:
    """``live_sessions`` concurrent chats; a session ends after a geometric number of
    turns (mean ``mean_turns``) and a new one starts. Each turn adds the previous answer
    and a new message (1-4 blocks; the first message 2-16 blocks) to the history."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    system = [ids.take(int(rng.integers(2, 9))) for _ in range(prompts)]
    # (next arrival ms, history) per live session; the next request is the earliest
    # arrival, found by a linear scan (a few hundred sessions: cheap for a generator).
    sessions: list[tuple[float, list[int]]] = []
    for _ in range(live_sessions):
        start = float(rng.exponential(mean_think_ms))
        sessions.append(
            (start, system[int(rng.integers(prompts))] + ids.take(int(rng.integers(2, 17))))
        )
    for _ in range(requests):
        i = min(range(len(sessions)), key=lambda j: sessions[j][0])
        t, history = sessions[i]
        yield Record(int(t), list(history))
        if rng.random() < 1.0 / mean_turns:
            nxt = t + float(rng.exponential(mean_think_ms))
            history = system[int(rng.integers(prompts))] + ids.take(int(rng.integers(2, 17)))
        else:
            nxt = t + float(rng.exponential(mean_think_ms))
            history = history + ids.take(int(rng.integers(1, 5)))
        sessions[i] = (nxt, history)


GENERATORS: dict[str, Callable[..., Iterator[Record]]] = {
    "shared-prompts": shared_prompts,
    "multi-turn": multi_turn,
}


def write(name: str, path: str, requests: int, seed: int | None = None) -> int:
    """Write ``requests`` records of generator ``name`` to ``path``; returns the count."""
    gen = GENERATORS[name]
    kwargs: dict[str, int] = {"requests": requests}
    if seed is not None:
        kwargs["seed"] = seed
    n = 0
    with open(path, "w") as f:
        for rec in gen(**kwargs):
            f.write(rec.to_json() + "\n")
            n += 1
    return n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", choices=sorted(GENERATORS))
    ap.add_argument("path")
    ap.add_argument("--requests", type=int, default=6000)
    ap.add_argument("--seed", type=int, default=None)
    a = ap.parse_args(argv)
    write(a.name, a.path, a.requests, a.seed)


if __name__ == "__main__":
    main()
