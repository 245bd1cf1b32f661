"""Model presets: geometries shaped like real engines' KV caches.

``dsv41_flash`` follows DeepSeek-V4.1-Flash as described in the design notes. The
layer counts are illustrative (the model's card does not publish them) and are
parameters; the defaults are 44 layers, all with a sliding-window cache of 128 tokens
(32 tokens per block) split into two engine groups, every second layer a kv-source
layer with a compressed-KV group (64 tokens per block, two tokens per stored state) and
a sparse-indexer group, plus a compressor scratch ring that must never be cached.

Records (bytes per stored state): ``fp8_ds_mla`` is 584 B on SM90 and every non-SM100
arch (pages aligned to 576-byte rows), 528 B on SM100 (512-byte rows); the indexer key
is 132 B. A page is one block of one layer:
``round_up(states_per_block * bytes_per_state, alignment)`` bytes, and ``stride_pad``
pads the block stride further, as engines may.

Each group lives in its own buffer holding all its layers, ``num_blocks`` blocks per
layer. ``placement="layer"`` (the default) puts layer ``l``, block ``b`` at ``l *
num_blocks * stride + b * stride`` (layer-outermost, a tensor per layer laid end to
end); ``placement="block"`` at ``b * n_layers * stride + l * stride`` (block-outermost:
every layer of a block side by side, as vLLM lays out DeepSeek-V4's KV cache).

``llama3_8b`` is an ordinary model as vLLM lays it out: one KV tensor per layer (its own
buffer, as vLLM allocates one per attention layer), 32 layers of 8 KV heads of 128
dims, bf16, 16-token blocks, in the shape of one attention backend: ``flash_attn``
(``[2, num_blocks, block_size, heads, head_dim]``: a K plane and a V plane, so a block
of a layer is two 32 KiB pages ``num_blocks`` pages apart) or ``flashinfer``
(``[num_blocks, 2, block_size, heads, head_dim]``: K and V of a block side by side, one
64 KiB page). ``placement="block"`` puts every layer in one buffer, block outermost
(``[num_blocks, layers, ...]``, a cross-layer layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmc_server.cache.geometry import GroupSpec, LayerSpec, blocks_per_chunk

MAIN_RECORD = {"sm100": (528, 512)}
PLACEMENTS = ("layer", "block")
ATTENTION_BACKENDS = ("flash_attn", "flashinfer")
DEFAULT_MAIN_RECORD = (584, 576)
INDEXER_BYTES = 132


@dataclass(frozen=True)
class KVGeometry:
    """Groups plus the size of each buffer they index (buffer ``i`` = ``buffer_sizes[i]``)."""

    model: str
    kv_dtype: str
    arch: str
    groups: list[GroupSpec]
    buffer_sizes: list[int]
    notes: dict[str, int] = field(default_factory=dict)

    def chunk_bytes(self, chunk_size: int) -> int:
        """L1 bytes one chunk occupies (window groups store only their window)."""
        total = 0
        for g in self.groups:
            if not g.cached:
                continue
            bpc = blocks_per_chunk(g, chunk_size)
            if g.kind == "sliding_window":
                bpc = min(bpc, -(-g.window_tokens // g.tokens_per_block))
            total += sum(layer.page_bytes for layer in g.layers) * bpc
        return total


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _group(
    name: str,
    kind: str,
    buffer: int,
    n_layers: int,
    num_blocks: int,
    tokens_per_block: int,
    states_per_block: int,
    record: str,
    bytes_per_state: int,
    align: int,
    stride_pad: int,
    window: int = 0,
    placement: str = "layer",
) -> tuple[GroupSpec, int]:
    if placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r}: expected one of {PLACEMENTS}")
    page = round_up(states_per_block * bytes_per_state, align)
    stride = page + stride_pad
    if placement == "layer":
        layer_stride, block_stride = num_blocks * stride, stride
    else:
        layer_stride, block_stride = stride, n_layers * stride
    layers = [
        LayerSpec(
            buffer=buffer,
            offset=i * layer_stride,
            block_stride=block_stride,
            page_bytes=page,
            name=f"{name}.{i}",
        )
        for i in range(n_layers)
    ]
    spec = GroupSpec(
        name=name,
        kind=kind,  # type: ignore[arg-type]
        tokens_per_block=tokens_per_block,
        states_per_block=states_per_block,
        record_format=record,
        bytes_per_state=bytes_per_state,
        num_blocks=num_blocks,
        layers=layers,
        window_tokens=window,
    )
    return spec, n_layers * num_blocks * stride


def dsv41_flash(
    arch: str = "sm90",
    num_blocks: int = 64,
    layers: int = 44,
    sliding_groups: int = 2,
    kv_source_every: int = 2,
    window_tokens: int = 128,
    stride_pad: int = 0,
    scratch: bool = True,
    model: str = "deepseek-ai/DeepSeek-V4.1-Flash",
    placement: str = "layer",
) -> KVGeometry:
    """The DeepSeek-V4.1-Flash preset (``fp8_ds_mla`` KV, MLA: replicated across ranks)."""
    main_bytes, main_align = MAIN_RECORD.get(arch, DEFAULT_MAIN_RECORD)
    groups: list[GroupSpec] = []
    sizes: list[int] = []
    per_group = [
        layers // sliding_groups + (1 if i < layers % sliding_groups else 0)
        for i in range(sliding_groups)
    ]
    for i, n in enumerate(per_group):
        g, size = _group(
            f"swa{i}",
            "sliding_window",
            len(sizes),
            n,
            num_blocks,
            32,
            32,
            "fp8_ds_mla",
            main_bytes,
            main_align,
            stride_pad,
            window_tokens,
            placement,
        )
        groups.append(g)
        sizes.append(size)
    kv_layers = layers // kv_source_every
    g, size = _group(
        "compressed",
        "full",
        len(sizes),
        kv_layers,
        num_blocks,
        64,
        32,
        "fp8_ds_mla",
        main_bytes,
        main_align,
        stride_pad,
        placement=placement,
    )
    groups.append(g)
    sizes.append(size)
    g, size = _group(
        "indexer",
        "full",
        len(sizes),
        kv_layers,
        num_blocks,
        64,
        32,
        "indexer_fp8",
        INDEXER_BYTES,
        1,
        stride_pad,
        placement=placement,
    )
    groups.append(g)
    sizes.append(size)
    if scratch:
        g, size = _group(
            "compressor_scratch",
            "scratch",
            len(sizes),
            kv_layers,
            num_blocks,
            8,
            8,
            "bf16",
            512,
            1,
            0,
            placement=placement,
        )
        groups.append(g)
        sizes.append(size)
    return KVGeometry(
        model=model, kv_dtype="fp8_ds_mla", arch=arch, groups=groups, buffer_sizes=sizes
    )


def simple_model(
    arch: str = "sm90",
    num_blocks: int = 64,
    layers: int = 4,
    tokens_per_block: int = 16,
    bytes_per_token: int = 1024,
    model: str = "test/simple",
) -> KVGeometry:
    """An ordinary full-attention model: one group, one page per layer per block."""
    g, size = _group(
        "full",
        "full",
        0,
        layers,
        num_blocks,
        tokens_per_block,
        tokens_per_block,
        "bf16",
        bytes_per_token,
        1,
        0,
    )
    return KVGeometry(model=model, kv_dtype="bf16", arch=arch, groups=[g], buffer_sizes=[size])


def llama3_8b(
    arch: str = "sm90",
    num_blocks: int = 64,
    layers: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    backend: str = "flash_attn",
    placement: str = "layer",
    model: str = "meta-llama/Meta-Llama-3-8B",
) -> KVGeometry:
    """A Llama-3-8B-shaped KV cache (bf16, full attention) in one backend's shape.

    ``flash_attn``: each layer declares two pages per block, K then V (the planes sit
    ``num_blocks`` blocks apart in its tensor); ``flashinfer``: one page per block, K
    and V side by side. With ``placement="layer"`` buffer ``l`` is layer ``l``'s
    tensor; with ``"block"`` buffer 0 holds every layer, block outermost.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {backend!r}: expected one of {ATTENTION_BACKENDS}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r}: expected one of {PLACEMENTS}")
    plane = block_size * kv_heads * head_dim * 2  # bytes of K (or V) of one block
    layer_bytes = 2 * num_blocks * plane
    specs: list[LayerSpec] = []
    for i in range(layers):
        name = f"model.layers.{i}.self_attn.attn"
        if placement == "layer":
            buf, base, stride = i, 0, 2 * plane
        else:
            buf, base, stride = 0, i * 2 * plane, layers * 2 * plane
        if backend == "flashinfer":
            specs.append(LayerSpec(buf, base, stride, 2 * plane, name))
        elif placement == "layer":  # [2, num_blocks, ...]: the V plane after every K page
            specs.append(LayerSpec(buf, base, plane, plane, f"{name}.k"))
            specs.append(LayerSpec(buf, base + num_blocks * plane, plane, plane, f"{name}.v"))
        else:  # block-outermost: K and V of a block and layer side by side
            specs.append(LayerSpec(buf, base, stride, plane, f"{name}.k"))
            specs.append(LayerSpec(buf, base + plane, stride, plane, f"{name}.v"))
    state = plane // block_size * (2 if backend == "flashinfer" else 1)
    group = GroupSpec(
        name="full",
        kind="full",
        tokens_per_block=block_size,
        states_per_block=block_size,
        record_format="bf16",
        bytes_per_state=state,
        num_blocks=num_blocks,
        layers=specs,
    )
    sizes = [layer_bytes] * layers if placement == "layer" else [layers * layer_bytes]
    return KVGeometry(
        model=model,
        kv_dtype="bf16",
        arch=arch,
        groups=[group],
        buffer_sizes=sizes,
        notes={"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim},
    )
