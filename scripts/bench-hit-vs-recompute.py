"""Time to first token of a connector hit against recomputing the same prompt, on a GPU.

The target: a hit of two chunks reaches its first token no later than
recomputing it would. For prompts of ``n`` whole 256-token chunks and one more token
(the hit covers the chunks, the engine computes the last token), on one GPU:

* ``load_s``: the connector's hit path, from the scheduler's decision (the engine
  allocated the request's blocks for the hit) to the worker reporting the loaded blocks
  ready (``finished_recving``): the connector's planner, worker transfers and link, a
  real ``lmcache server --backend cuda``, GPU memory exported as CUDA IPC handles,
  every load checked byte-exact (:mod:`lmc_server.testing.connector_timing`, as
  ``tests/gpu/test_connector_load_time.py``). Median of ``--repeats``.
* ``tail_s``: the forward pass the hit still needs, the last token over the ``n * 256``
  loaded ones.
* ``recompute_s``: the forward pass of the whole prompt (``n * 256 + 1`` tokens) with
  no hit.

The forward passes are a Llama-3-8B-like decoder stack in plain torch (32 layers,
hidden 4096, 32 query and 8 KV heads of 128, SwiGLU 14336, bf16, random weights;
PyTorch's scaled-dot-product attention, no RoPE, no fused kernels), timed with CUDA
events, median of ``--repeats``, each pass both eagerly and as the replay of a CUDA
graph captured once. vLLM replays captured graphs for small steps (a hit's one-token
tail is one), so ``tail_s`` is the graph's time; eagerly, 32 layers of about 15
kernels each are paid in Python launches (about 15 ms on the H200 host, four times
the 3.5 ms it takes to read the 16 GB of weights once), which would measure the
launcher, not the hit. ``recompute_s`` is the faster of the two passes. Its KV is
4 KiB per token per layer, the cache the load moves (128 KiB per token: 32 MiB per
chunk). vLLM's own kernels are faster than this plain stack, so ``recompute_s``
flatters recomputation's cost upward; the ``floor`` figures are what any
implementation pays at least: the stack's weight matrix products alone (no attention,
norms or activations). The verdict is given against both: ``hit_s = load_s + tail_s``
against ``recompute_s`` and ``recompute_floor_s``. Every pass's eager and graph time
is in the JSON row (``tail_eager_s``, ``recompute_graph_s``, ...).

Not included: the engine steps the connector adds before a hit's prefill (measured
apart, on vLLM's scheduler: ``scripts/bench-connector-steps.py``, docs/benchmarks.md).

Run on a GPU machine from the repository root (the project importable, torch and
cupy installed):

    PYTHONPATH=$PWD python3 scripts/bench-hit-vs-recompute.py --json $OUT/hit-vs-recompute.json

``--backend cpu`` runs the same on the CPU engine and a CPU forward (a check of the
script, not a figure of interest; use ``--layers 1`` there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SERVER_ARGS = ["--chunk-size", "256", "--separate-object-groups", "--eviction-policy", "LRU"]
CHUNK = 256
#: Llama-3-8B's decoder dimensions
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 4096, 32, 8, 128, 14336
#: KV bytes per token per layer (K and V, 8 heads of 128, bf16)
KV_BYTES_PER_TOKEN = 2 * KV_HEADS * HEAD_DIM * 2


class DecoderStack:
    """``layers`` Llama-like decoder layers with random weights on ``device``."""

    def __init__(self, layers: int, device: Any, seed: int = 0) -> None:
        import torch

        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        self.device = device

        def w(*shape: int) -> Any:
            return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16) * 0.02

        qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.layers = [
            dict(
                qkv=w(HIDDEN, qkv),
                o=w(HEADS * HEAD_DIM, HIDDEN),
                gate_up=w(HIDDEN, 2 * FFN),
                down=w(FFN, HIDDEN),
                norm1=torch.ones(HIDDEN, device=device, dtype=torch.bfloat16),
                norm2=torch.ones(HIDDEN, device=device, dtype=torch.bfloat16),
            )
            for _ in range(layers)
        ]

    def inputs(self, new_tokens: int, past_tokens: int) -> tuple[Any, Any, Any]:
        """Random activations of ``new_tokens`` and a random past KV of ``past_tokens``
        (only their shapes matter for the time), allocated once so that a CUDA graph
        can replay over them."""
        import torch

        x = torch.randn(1, new_tokens, HIDDEN, device=self.device, dtype=torch.bfloat16)
        past_k = past_v = None
        if past_tokens:
            past_k = torch.randn(
                1, HEADS, past_tokens, HEAD_DIM, device=self.device, dtype=torch.bfloat16
            )
            past_v = torch.randn_like(past_k)
        return x, past_k, past_v

    def forward(self, x: Any, past_k: Any, past_v: Any, matmuls_only: bool = False) -> Any:
        """One forward pass of the tokens of ``x`` over the past KV (``None``: none)."""
        import torch
        import torch.nn.functional as F

        new_tokens = x.shape[1]
        rep = HEADS // KV_HEADS
        for p in self.layers:
            if matmuls_only:
                a = x @ p["qkv"]
                x = a[..., : HEADS * HEAD_DIM] @ p["o"]
                g = x @ p["gate_up"]
                x = g[..., :FFN] @ p["down"]
                continue
            h = _rms_norm(x, p["norm1"])
            q, k, v = (h @ p["qkv"]).split(
                [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1
            )
            q = q.view(1, new_tokens, HEADS, HEAD_DIM).transpose(1, 2)
            k = k.view(1, new_tokens, KV_HEADS, HEAD_DIM).transpose(1, 2)
            v = v.view(1, new_tokens, KV_HEADS, HEAD_DIM).transpose(1, 2)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            if past_k is not None:
                k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
            # no past: causal; one new token over a past: it sees every position
            att = F.scaled_dot_product_attention(q, k, v, is_causal=past_k is None)
            x = x + att.transpose(1, 2).reshape(1, new_tokens, HEADS * HEAD_DIM) @ p["o"]
            h = _rms_norm(x, p["norm2"])
            gate, up = (h @ p["gate_up"]).split([FFN, FFN], dim=-1)
            x = x + (F.silu(gate) * up) @ p["down"]
        return x

    def runner(
        self, new_tokens: int, past_tokens: int, *, graph: bool, matmuls_only: bool = False
    ) -> Callable[[], Any]:
        """A callable that runs one forward pass: eagerly, or as the replay of a CUDA
        graph captured once (what vLLM does for the step sizes it captures, so that a
        pass is not paid in kernel launches from Python)."""
        import torch

        x, past_k, past_v = self.inputs(new_tokens, 0 if matmuls_only else past_tokens)
        run = partial(self.forward, x, past_k, past_v, matmuls_only)
        if not graph:
            return run
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        return g.replay


def _rms_norm(x: Any, weight: Any, eps: float = 1e-5) -> Any:
    import torch

    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype) * weight


def timed(fn: Callable[[], Any], device: Any, repeats: int, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU, the clock on the CPU)."""
    import torch

    cuda = device.type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    times_s = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times_s.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times_s.append(time.perf_counter() - t0)
    return statistics.median(times_s)


def load_figures(
    backend: str, chunks: list[int], repeats: int, layers: int
) -> dict[int, dict[str, float]]:
    """The connector's hit path for each hit size (:func:`load_times`), over a KV cache
    of ``layers`` layers of the stack's KV size, on the ``backend`` engine."""
    from lmc_server.testing.connector_timing import blocks_needed, load_times
    from lmc_server.testing.presets import simple_model
    from lmc_server.testing.process import ServerProcess

    pool_gb = max(2.0, 2 * max(chunks) * CHUNK * layers * KV_BYTES_PER_TOKEN / 2**30 + 1)
    if backend == "cuda":
        from lmc_server.client.cuda import stream_done
        from lmc_server.testing.cuda_kv import CudaKV, device_arch

        geo = simple_model(
            arch=device_arch(0),
            num_blocks=blocks_needed(chunks),
            layers=layers,
            bytes_per_token=KV_BYTES_PER_TOKEN,
        )
        with (
            ServerProcess(
                SERVER_ARGS, backend="cuda", l1_size_gb=pool_gb, start_timeout_s=60
            ) as srv,
            CudaKV(geo) as kv,
        ):
            srv.wait_pool_ready()
            kv.fill_random(23)
            return load_times(srv.endpoint, kv, chunks, repeats=repeats, ready=stream_done())
    from lmc_server.testing.kv import ShmKV

    geo = simple_model(
        num_blocks=blocks_needed(chunks), layers=layers, bytes_per_token=KV_BYTES_PER_TOKEN
    )
    with ServerProcess(SERVER_ARGS, l1_size_gb=pool_gb) as srv, ShmKV(geo) as kv:
        kv.fill_random(23)
        return load_times(srv.endpoint, kv, chunks, repeats=repeats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", default="1,2,16", help="hit sizes, in 256-token chunks")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (Llama-3-8B: 32)")
    ap.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args()
    import torch

    chunks = [int(c) for c in args.chunks.split(",")]
    device = torch.device("cuda", 0) if args.backend == "cuda" else torch.device("cpu")
    loads = load_figures(args.backend, chunks, args.repeats, args.layers)
    stack = DecoderStack(args.layers, device)
    rows = []
    graphs = [False, True] if device.type == "cuda" else [False]
    with torch.inference_mode():
        for n in chunks:
            hit_tokens = n * CHUNK
            t: dict[str, float] = {}
            for graph in graphs:
                how = "graph" if graph else "eager"
                for name, new_tok, past, mm in (
                    ("recompute", hit_tokens + 1, 0, False),
                    ("floor", hit_tokens + 1, 0, True),
                    ("tail", 1, hit_tokens, False),
                ):
                    run = stack.runner(new_tok, past, graph=graph, matmuls_only=mm)
                    t[f"{name}_{how}_s"] = timed(run, device, args.repeats)
                    del run
                if graph:
                    torch.cuda.empty_cache()
            best = "graph" if device.type == "cuda" else "eager"
            load_s = loads[n]["median_s"]
            # the hit's tail is one token: vLLM replays a captured graph for it; the
            # recompute is whichever of the two passes is faster
            tail_s = t[f"tail_{best}_s"]
            recompute_s = min(
                t[f"recompute_{h}_s"] for h in ("eager", "graph") if f"recompute_{h}_s" in t
            )
            floor_s = min(t[f"floor_{h}_s"] for h in ("eager", "graph") if f"floor_{h}_s" in t)
            hit_s = load_s + tail_s
            row = {
                "chunks": n,
                "prompt_tokens": hit_tokens + 1,
                "load_bytes": hit_tokens * args.layers * KV_BYTES_PER_TOKEN,
                "load_s": load_s,
                "load_max_s": loads[n]["max_s"],
                "tail_s": tail_s,
                "hit_s": hit_s,
                "recompute_s": recompute_s,
                "recompute_floor_s": floor_s,
                **t,
                "hit_no_later_than_recompute": hit_s <= recompute_s,
                "hit_no_later_than_recompute_floor": hit_s <= floor_s,
            }
            rows.append(row)
            print(
                f"{n:3} chunks ({row['load_bytes'] / 2**20:6.0f} MiB): hit {1e3 * hit_s:7.2f} "
                f"ms (load {1e3 * load_s:.2f}, max {1e3 * row['load_max_s']:.2f}; tail "
                f"{1e3 * tail_s:.2f}) vs recompute {1e3 * recompute_s:7.2f} ms (matmul "
                f"floor {1e3 * floor_s:.2f}); "
                + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in t.items()),
                flush=True,
            )
    out = {
        "device": (torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"),
        "backend": args.backend,
        "layers": args.layers,
        "repeats": args.repeats,
        "model": f"Llama-3-8B-like: hidden {HIDDEN}, {HEADS}/{KV_HEADS} heads of "
        f"{HEAD_DIM}, ffn {FFN}, bf16",
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
