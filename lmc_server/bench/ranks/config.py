"""What both sides of ``lmcache bench ranks`` agree on: settings, regions, chunk keys.

The parent (:mod:`.run`) and every rank process (:mod:`.worker`) import this,
and nothing of each other: the parent sends a rank its settings as one JSON line.

Data-parallel prompts (``mode="dp"``): engine ``e`` of ``n`` owns prompts ``q = j * n + e``
(``j = 0, 1, ...``), so any engine knows who stored a prompt from its id alone. Chunk
``k`` of prompt ``q`` is stored from region-A slot :func:`prompt_slots` and tagged with
``(q, k)`` (:data:`TAG_BYTES` at the start of every page), so its bytes are the same on
every engine and differ from every other prompt's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import click
import numpy as np

from lmc_server.bench.common import DEFAULT_CHUNK_SIZE, GeometryArgs
from lmc_server.bench.options import BACKENDS, ints, opt, words
from lmc_server.cache.geometry import blocks_per_chunk
from lmc_server.config import CUDA_COPY_MODES
from lmc_server.testing.presets import KVGeometry

REGION_A, REGION_B = 0, 1
KILL_DETECT_S = 5.0
POOL_READY_TIMEOUT_S = 600.0
MAX_ERRORS_KEPT = 5
#: Raw copies are at least this large, so that a small geometry is not timed in cache.
RAW_MIN_BYTES = 64 << 20
#: Phase 2 stores a chunk again while another rank is writing it, so that every chunk
#: ends committed or failed (exact single-copy accounting), this often, this long.
IN_PROGRESS_POLL_S = 0.002
IN_PROGRESS_RETRY_S = 2.0
#: DP mode: a load picks one of this many most recent prompts of the engine it reads.
DP_RECENT_PROMPTS = 8
#: DP mode: bytes at the start of every page that carry the prompt's tag.
TAG_BYTES = 16
#: DP mode: what an engine counts of its loads (its replies carry them; the parent sums).
DP_LOAD_COUNTS = (
    "lookups",
    "lookup_misses",
    "partial_hits",
    "loads",
    "cross_engine_chunks",
    "own_chunks",
    "failed_load_chunks",
    "verified_loads",
    "checked_bytes",
    "mismatched_bytes",
)
MODES = ("tp", "dp")
TP_MODES = ("load", "mixed")
#: Requests a rank keeps in flight in a TP phase, at most.
MAX_TP_INFLIGHT = 64


@dataclass(frozen=True)
class RanksConfig:
    mode: str = opt(
        "tp",
        "tp: the tensor-parallel ranks of one engine (replicated KV; phases 1-3 "
        "and the TP phases). dp: independent data-parallel engines, each rank 0 of "
        "world size 1 (one namespace), storing their own prompts and loading "
        "prefixes any engine stored, at their own pace (the DP phase, phase 3).",
        type=click.Choice(MODES),
    )
    backend: str = opt(
        "cpu",
        "Transfer engine of the server; cuda: ranks round-robin over the GPUs.",
        type=BACKENDS,
    )
    ranks: int = opt(
        8,
        "Worker processes, one registration each (TP ranks, or DP engines).",
        type=click.IntRange(1, 256),
    )
    chunks: int = opt(
        1000,
        "Chunks rank 0 stores in phase 1 (and slots of each KV region).",
        type=click.IntRange(1),
    )
    duration_s: float = opt(
        60.0,
        "Seconds of concurrent store/retrieve on every rank (phase 2; the DP "
        "phase with --mode dp).",
        type=click.FloatRange(min=0.1),
    )
    kill_one: bool = opt(
        True, "SIGKILL the last rank halfway through phase 2 or the DP phase (phase 3)."
    )
    cuda_copy_mode: str = opt(
        "auto",
        "cuda only: the server's --cuda-copy-mode. dma keeps the copy engines whatever "
        "the rows' width (auto takes staging for narrow rows on an idle GPU), so a small "
        "--layers geometry issues the same copies per request as the full one.",
        type=click.Choice(CUDA_COPY_MODES),
    )
    geometry: GeometryArgs = GeometryArgs()
    num_blocks: int | None = opt(
        None,
        "Blocks per KV group [default: the least two regions of --chunks need].",
        type=click.IntRange(1),
    )
    #: At most ``chunks`` (cut to it at construction).
    batch: int = opt(
        16,
        "Chunks per request in phase 1 stores and phase 2; with --mode dp, "
        "chunks per prompt (each store, and the longest load).",
        type=click.IntRange(1),
    )
    l1_size_gb: float | None = opt(
        None,
        "Server pool [default: twice the phase-1 bytes plus 1 GiB].",
        type=click.FloatRange(min=0.1),
    )
    verify_every: int = opt(
        8,
        "Phase 2: compare every n-th successful retrieve byte for byte (DP "
        "mode compares every load).",
        type=click.IntRange(1),
    )
    raw_s: float = opt(
        1.0, "Seconds of each raw-copy baseline direction.", type=click.FloatRange(min=0.01)
    )
    tp_modes: tuple[str, ...] = opt(
        ("load", "mixed"),
        "Steady-state TP phases, comma-separated: load (every rank retrieves the "
        "same prefix at once), mixed (and rank 0 stores meanwhile); '' for none.",
        parse=words,
    )
    tp_s: float = opt(5.0, "Seconds each TP phase runs.", type=click.FloatRange(min=0.1))
    #: Chunks per TP request, each TP mode run for every (chunks, inflight) pair;
    #: ``None``: ``(batch,)``.
    tp_chunks: tuple[int, ...] | None = opt(
        None,
        "Chunks per TP request (the prefix length), comma-separated (1,4,16,64): "
        "each TP mode runs for every pair of --tp-chunks and --tp-inflight; at most "
        "--chunks [default: --batch].",
        parse=ints,
    )
    tp_inflight: tuple[int, ...] = opt(
        (1,),
        f"Requests each rank keeps in flight in the TP phases, comma-separated "
        f"(1,2,4; each at most {MAX_TP_INFLIGHT}).",
        parse=ints,
    )
    seed: int = 0
    chunk_size: int = DEFAULT_CHUNK_SIZE

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch", min(self.batch, self.chunks))


def tp_pairs(cfg: RanksConfig) -> list[tuple[int, int]]:
    """The (chunks per request, requests in flight per rank) pairs each TP mode runs."""
    return [(c, i) for c in (cfg.tp_chunks or (cfg.batch,)) for i in cfg.tp_inflight]


def blocks_needed(geometry: KVGeometry, chunks: int, chunk_size: int) -> int:
    """Blocks per group for regions A and B of ``chunks`` chunk slots each."""
    return 2 * chunks * max(blocks_per_chunk(g, chunk_size) for g in geometry.groups if g.cached)


def digests(seed: int, phase: str, indices: Sequence[int] | np.ndarray) -> bytes:
    """32-byte keys of chunk ``indices`` of a phase; the same on every rank."""
    return b"".join(
        hashlib.blake2b(f"{seed}:{phase}:{int(i)}".encode(), digest_size=32).digest()
        for i in indices
    )


def prompt_digests(seed: int, prompt: int, n: int) -> bytes:
    """Keys of the first ``n`` chunks of DP prompt ``prompt``; the same on every engine."""
    return digests(seed, f"dp:{prompt}", range(n))


def prompt_owner(prompt: int, engines: int) -> int:
    return prompt % engines


def prompt_slots(prompt: int, n: int, chunks: int) -> np.ndarray:
    """Region-A slots chunks ``0..n-1`` of DP prompt ``prompt`` are stored from."""
    return (prompt * n + np.arange(n)) % chunks


def auto_l1_size_gb(chunk_bytes: int, chunks: int) -> float:
    """Room for phase 1 twice over plus 1 GiB, so phase 1 never evicts."""
    return round(-(-(2 * chunks * chunk_bytes + (1 << 30)) // (1 << 28)) / 4, 2)
