"""The memory plan: everything the process puts on the card, against the profile's budget and
the memory actually free on the device.

Weights and KV are exact arithmetic from the GGUF (llama.cpp pads n_ctx to 256 and gives
sliding-window layers n_swa + n_ubatch cells). Compute buffers follow what llama.cpp reserves,
fitted to its own reports (CUDA with flash attention: the largest of the logits, the FFN section
with the KQ mask, and, for a quantized KV, the f16 copy of one layer's K and V); the CUDA context
and the backend's growth during the first prefill are measured constants (docs/MEMORY.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import psutil

from localchat.errors import ProfileError
from localchat.models import ModelInfo
from localchat.profiles import KV_TYPES, QUANTIZED, Profile

GIB, MIB = 1 << 30, 1 << 20
CTX_STEP = 256
# llama.cpp's CPU-side buffers beyond the weights: logits, token/embedding staging, graph
HOST_OVERHEAD = 64 << 20
# measured on an H200 (driver 580, CUDA 13, llama.cpp of llama-cpp-python 0.3.36): device memory a
# process holds once CUDA starts, before any buffer (docs/MEMORY.md); smaller cards' contexts are smaller
CUDA_CONTEXT = 524 * MIB
# measured likewise: what the CUDA backend adds during the first prefill (cuBLAS workspace, its pool),
# the same after 4,000 tokens and at a full context, for 7B and 8B shapes, f16 and q8_0 KV
PREFILL_GROWTH = 78 * MIB
SMALL_BUFFERS = 8 * MIB  # small tensors and allocations besides the named buffers (measured 3-6 MiB)


def compute_slack(m: ModelInfo, p: Profile) -> int:
    """ggml's graph allocator can fragment past the largest section by about one FFN activation
    (measured: 30 MiB on the 7B shape at one n_ctx of ten): room kept for it on a GPU."""
    return min(p.n_ubatch, p.n_batch) * 4 * (m.n_ff + 2 * m.n_embd)


@dataclass(frozen=True)
class MemoryPlan:
    """`localchat plan --json` prints this; its keys are documented in README.md."""

    model: str
    profile: str
    gpu: bool
    n_ctx: int
    n_ctx_train: int
    type_k: str
    type_v: str
    layers_total: int
    layers_gpu: int
    weights_gpu_bytes: int
    weights_cpu_bytes: int
    kv_bytes_per_token: int  # all layers, the profile's KV type
    kv_bytes_per_token_swa: int  # of that, sliding-window layers (held only for their window)
    kv_cells_swa: int
    kv_bytes: int  # at n_ctx
    kv_gpu_bytes: int
    compute_bytes: int
    total_gpu_bytes: int
    budget_bytes: int  # vram_gb - reserve_gb, or available RAM on a CPU profile
    fits: bool
    max_ctx: dict[str, int]  # largest n_ctx that fits per KV type (0: none)
    cuda_context_bytes: int = 0  # in total_gpu_bytes: the process's CUDA context (measured constant)
    prefill_growth_bytes: int = 0  # in total_gpu_bytes: the backend's growth during prefill (measured constant)
    device_free_bytes: int = 0  # free on the device at start, our CUDA context already made (0: not read)
    free_margin_bytes: int = 0  # kept free of that on top (profile key free_margin_gb)
    limited_by: str = "profile"  # what set the room: profile, free memory

    def to_json(self) -> dict:
        return asdict(self)


def _layers_on_gpu(p: Profile, m: ModelInfo) -> int:
    if p.n_gpu_layers < 0:
        return m.n_layer + 1
    return min(p.n_gpu_layers, m.n_layer + 1)


def _compute_bytes(m: ModelInfo, p: Profile, n_ctx: int, type_k: str, gpu: bool) -> int:
    ub = min(p.n_ubatch, p.n_batch)
    logits = ub * 4 * (m.n_vocab + m.n_embd)
    if not p.flash_attn:  # the attention scores of a whole ubatch are materialized
        return ub * 4 * (m.n_vocab + 4 * m.n_embd + 2 * m.n_ff) + ub * n_ctx * m.n_head * 4
    if not gpu:
        return logits + ub * 4 * m.n_embd  # measured on the CPU backend: logits + two embedding rows
    ffn = ub * 4 * 3 * (m.n_ff + m.n_embd) + ub * 2 * n_ctx  # with the f16 KQ mask
    # a quantized KV is converted to f16 for the flash-attention kernel, one layer's K and V at a time
    kv_width = 2 * (m.head_dim_k + m.head_dim_v) * max(m.n_head_kv, default=0)
    converted = ub * 4 * 4 * m.n_embd + n_ctx * (ub * 2 + kv_width) if type_k in QUANTIZED else 0
    return max(logits, ffn, converted)


def _usage(p: Profile, m: ModelInfo, n_ctx: int, type_k: str, type_v: str) -> tuple[int, int, int, int]:
    """(weights on GPU, KV bytes, KV on GPU, compute) at n_ctx."""
    layers_gpu = _layers_on_gpu(p, m)
    repeating = min(layers_gpu, m.n_layer)
    weights_gpu = sum(m.layer_bytes[m.n_layer - repeating:]) + (m.output_bytes if layers_gpu > m.n_layer else 0)
    kv = m.kv_bytes(n_ctx, type_k, type_v, p.n_ubatch, p.swa_full)
    kv_gpu = kv * repeating // max(m.n_layer, 1)
    return weights_gpu, kv, kv_gpu, _compute_bytes(m, p, n_ctx, type_k, _on_gpu(p))


def _on_gpu(p: Profile) -> bool:
    return p.vram_gb > 0 and p.offloads


def budget_bytes(p: Profile) -> int:
    if p.vram_gb > 0:
        return int((p.vram_gb - p.reserve_gb) * GIB)
    return int(psutil.virtual_memory().available - p.reserve_gb * GIB)


def room_for(p: Profile, free: int) -> tuple[int, str]:
    """What the plan's total may reach, and what set it: the profile's budget, or the memory free on
    the device now (read after our CUDA context was made, hence added back) less the margin."""
    budget = budget_bytes(p)
    if not (_on_gpu(p) and free):
        return budget, "profile"
    by_free = free - int(p.free_margin_gb * GIB) + CUDA_CONTEXT
    return (by_free, "free memory") if by_free < budget else (budget, "profile")


def _need(p: Profile, m: ModelInfo, n_ctx: int, type_k: str, type_v: str) -> int:
    weights_gpu, kv, kv_gpu, compute = _usage(p, m, n_ctx, type_k, type_v)
    if _on_gpu(p):
        return weights_gpu + kv_gpu + compute + compute_slack(m, p) + CUDA_CONTEXT + PREFILL_GROWTH + SMALL_BUFFERS
    # CPU: weights are memory-mapped but must stay resident to run at speed
    return m.tensor_bytes + kv + compute + HOST_OVERHEAD


def largest_ctx(p: Profile, m: ModelInfo, type_k: str, type_v: str, free: int = 0) -> int:
    """Largest multiple of 256 that fits the room, capped by the trained context (0: none)."""
    cap = m.n_ctx_train or 1 << 17
    room, _ = room_for(p, free)
    lo, hi = 0, cap // CTX_STEP
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _need(p, m, mid * CTX_STEP, type_k, type_v) <= room:
            lo = mid
        else:
            hi = mid - 1
    return lo * CTX_STEP


def make_plan(p: Profile, m: ModelInfo, n_ctx: int | None = None, free: int = 0) -> MemoryPlan:
    """The plan at the profile's n_ctx (or the largest that fits, for auto); `free` is the device's
    free memory read at start (0: not read, the profile's budget alone decides)."""
    if n_ctx is None:
        n_ctx = largest_ctx(p, m, p.type_k, p.type_v, free) if p.n_ctx == "auto" else int(p.n_ctx)
    n_ctx = -(-n_ctx // CTX_STEP) * CTX_STEP  # llama.cpp pads the context to 256
    weights_gpu, kv, kv_gpu, compute = _usage(p, m, n_ctx, p.type_k, p.type_v)
    gpu = _on_gpu(p)
    room, limited_by = room_for(p, free)
    return MemoryPlan(
        model=str(m.path), profile=p.name, gpu=gpu, n_ctx=n_ctx, n_ctx_train=m.n_ctx_train,
        type_k=p.type_k, type_v=p.type_v, layers_total=m.n_layer + 1, layers_gpu=_layers_on_gpu(p, m),
        weights_gpu_bytes=weights_gpu, weights_cpu_bytes=m.tensor_bytes - weights_gpu,
        kv_bytes_per_token=m.kv_bytes_per_token(p.type_k, p.type_v),
        kv_bytes_per_token_swa=m.kv_bytes_per_token(p.type_k, p.type_v, swa=True),
        kv_cells_swa=m.swa_cells(n_ctx, p.n_ubatch, p.swa_full) if m.n_swa else 0,
        kv_bytes=kv, kv_gpu_bytes=kv_gpu, compute_bytes=compute,
        total_gpu_bytes=_need(p, m, n_ctx, p.type_k, p.type_v) if gpu else 0, budget_bytes=budget_bytes(p),
        fits=n_ctx > 0 and _need(p, m, n_ctx, p.type_k, p.type_v) <= room,
        max_ctx={t: largest_ctx(p, m, t, t if p.flash_attn or t == "f16" else "f16", free) for t in KV_TYPES},
        cuda_context_bytes=CUDA_CONTEXT if gpu else 0, prefill_growth_bytes=PREFILL_GROWTH if gpu else 0,
        device_free_bytes=free if gpu else 0, free_margin_bytes=int(p.free_margin_gb * GIB) if gpu else 0,
        limited_by=limited_by,
    )


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def check_fits(plan: MemoryPlan, p: Profile) -> None:
    """Stop before loading when the plan does not fit, with the numbers and the fix."""
    if plan.n_ctx_train and plan.n_ctx > plan.n_ctx_train:
        raise ProfileError(f"{p.source}: n_ctx {plan.n_ctx} is above the model's trained context "
                           f"({plan.n_ctx_train}); set n_ctx: {plan.n_ctx_train} or less (or auto)")
    if plan.fits:
        return
    need = plan.total_gpu_bytes if plan.gpu else plan.kv_bytes + plan.weights_cpu_bytes + plan.compute_bytes
    where = "GPU memory" if plan.gpu else "free RAM"
    best = {t: c for t, c in plan.max_ctx.items() if c}
    fix = ", ".join(f"{t}: n_ctx {c}" for t, c in best.items()) or "a smaller model or fewer n_gpu_layers"
    if plan.limited_by == "free memory":
        room = (f"only {_gib(plan.device_free_bytes)} is free on the card now (plus {_gib(plan.cuda_context_bytes)} "
                f"of our own CUDA context, less a {_gib(plan.free_margin_bytes)} margin)")
    else:
        room = f"the budget is {_gib(plan.budget_bytes)}"
    raise ProfileError(f"{p.source}: needs {_gib(need)} of {where} at n_ctx {plan.n_ctx} "
                       f"({plan.type_k}/{plan.type_v} KV {_gib(plan.kv_bytes)}) but {room}; largest that fits: {fix}")


def describe(plan: MemoryPlan, allocated: dict[str, dict[str, int]] | None = None) -> list[str]:
    """The plan as lines of text for `localchat plan` and /profile; `allocated`: llama.cpp's own
    buffer sizes once the model is loaded (Engine.buffers), shown beside the plan's."""
    mib = lambda b: f"{b / MIB:,.0f} MiB"  # noqa: E731
    dev = "CUDA0" if plan.gpu else "CPU"

    def said(kind: str) -> str:
        have = (allocated or {}).get(kind, {})
        return f" (llama.cpp: {mib(have[dev])})" if dev in have else ""

    kvt = f"{plan.type_k}/{plan.type_v}"
    lines = [
        f"model      {plan.model}",
        f"layers     {plan.layers_gpu} of {plan.layers_total} on GPU" if plan.gpu else "layers     all on CPU",
        f"weights    GPU {mib(plan.weights_gpu_bytes)}, CPU {mib(plan.weights_cpu_bytes)}" + said("model"),
        f"KV         {plan.kv_bytes_per_token:,} bytes/token ({kvt}) x {plan.n_ctx:,} tokens = {mib(plan.kv_bytes)}"
        + said("KV"),
    ]
    if plan.kv_cells_swa:
        lines.append(f"           sliding-window layers ({plan.kv_bytes_per_token_swa:,} bytes/token) hold "
                     f"{plan.kv_cells_swa:,} cells")
    lines.append(f"compute    {mib(plan.compute_bytes)}" + said("compute"))
    if plan.gpu:
        other = plan.total_gpu_bytes - plan.weights_gpu_bytes - plan.kv_gpu_bytes - plan.compute_bytes
        lines.append(f"CUDA       context {mib(plan.cuda_context_bytes)}, growth during prefill "
                     f"{mib(plan.prefill_growth_bytes)}, allocator slack and small buffers "
                     f"{mib(other - plan.cuda_context_bytes - plan.prefill_growth_bytes)} (docs/MEMORY.md)")
    total = plan.total_gpu_bytes if plan.gpu else plan.weights_cpu_bytes + plan.kv_bytes + plan.compute_bytes
    lines.append(f"total      {mib(total)} of {mib(plan.budget_bytes)} {'GPU budget' if plan.gpu else 'free RAM'}"
                 f" -> {'fits' if plan.fits else 'DOES NOT FIT'}")
    if plan.device_free_bytes:
        lines.append(f"free now   {mib(plan.device_free_bytes)} on the card (less {mib(plan.free_margin_bytes)} "
                     f"margin): the {plan.limited_by} sets the room")
    lines.append("largest n_ctx that fits: " + ", ".join(f"{t} {c:,}" for t, c in plan.max_ctx.items()))
    return lines
