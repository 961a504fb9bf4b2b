"""The memory plan: weights, KV cache and compute buffers against the profile's budget.

KV figures are exact arithmetic from the GGUF (llama.cpp pads n_ctx to 256 and gives
sliding-window layers n_swa + n_ubatch cells); compute buffers are an estimate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import psutil

from localchat.errors import ProfileError
from localchat.models import ModelInfo
from localchat.profiles import KV_TYPES, Profile

GIB = 1 << 30
CTX_STEP = 256
# llama.cpp's CPU-side buffers beyond the weights: logits, token/embedding staging, graph
HOST_OVERHEAD = 64 << 20


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

    def to_json(self) -> dict:
        return asdict(self)


def _layers_on_gpu(p: Profile, m: ModelInfo) -> int:
    if p.n_gpu_layers < 0:
        return m.n_layer + 1
    return min(p.n_gpu_layers, m.n_layer + 1)


def _compute_bytes(m: ModelInfo, p: Profile, n_ctx: int) -> int:
    ub = min(p.n_ubatch, p.n_batch)
    base = ub * 4 * (m.n_vocab + 4 * m.n_embd + 2 * m.n_ff)
    # without flash attention the attention scores of a whole ubatch are materialized
    scores = 0 if p.flash_attn else ub * n_ctx * m.n_head * 4
    return base + scores


def _usage(p: Profile, m: ModelInfo, n_ctx: int, type_k: str, type_v: str) -> tuple[int, int, int, int]:
    """(weights on GPU, KV bytes, KV on GPU, compute) at n_ctx."""
    layers_gpu = _layers_on_gpu(p, m)
    repeating = min(layers_gpu, m.n_layer)
    weights_gpu = sum(m.layer_bytes[m.n_layer - repeating:]) + (m.output_bytes if layers_gpu > m.n_layer else 0)
    kv = m.kv_bytes(n_ctx, type_k, type_v, p.n_ubatch, p.swa_full)
    kv_gpu = kv * repeating // max(m.n_layer, 1)
    return weights_gpu, kv, kv_gpu, _compute_bytes(m, p, n_ctx)


def budget_bytes(p: Profile) -> int:
    if p.vram_gb > 0:
        return int((p.vram_gb - p.reserve_gb) * GIB)
    return int(psutil.virtual_memory().available - p.reserve_gb * GIB)


def _need(p: Profile, m: ModelInfo, n_ctx: int, type_k: str, type_v: str) -> int:
    weights_gpu, kv, kv_gpu, compute = _usage(p, m, n_ctx, type_k, type_v)
    if p.vram_gb > 0:
        return weights_gpu + kv_gpu + compute
    # CPU: weights are memory-mapped but must stay resident to run at speed
    return m.tensor_bytes + kv + compute + HOST_OVERHEAD


def largest_ctx(p: Profile, m: ModelInfo, type_k: str, type_v: str) -> int:
    """Largest multiple of 256 that fits the budget, capped by the trained context (0: none)."""
    cap = m.n_ctx_train or 1 << 17
    budget = budget_bytes(p)
    lo, hi = 0, cap // CTX_STEP
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _need(p, m, mid * CTX_STEP, type_k, type_v) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo * CTX_STEP


def make_plan(p: Profile, m: ModelInfo, n_ctx: int | None = None) -> MemoryPlan:
    if n_ctx is None:
        n_ctx = largest_ctx(p, m, p.type_k, p.type_v) if p.n_ctx == "auto" else int(p.n_ctx)
    n_ctx = -(-n_ctx // CTX_STEP) * CTX_STEP  # llama.cpp pads the context to 256
    weights_gpu, kv, kv_gpu, compute = _usage(p, m, n_ctx, p.type_k, p.type_v)
    gpu = p.vram_gb > 0 and p.offloads
    budget = budget_bytes(p)
    return MemoryPlan(
        model=str(m.path), profile=p.name, gpu=gpu, n_ctx=n_ctx, n_ctx_train=m.n_ctx_train,
        type_k=p.type_k, type_v=p.type_v, layers_total=m.n_layer + 1, layers_gpu=_layers_on_gpu(p, m),
        weights_gpu_bytes=weights_gpu, weights_cpu_bytes=m.tensor_bytes - weights_gpu,
        kv_bytes_per_token=m.kv_bytes_per_token(p.type_k, p.type_v),
        kv_bytes_per_token_swa=m.kv_bytes_per_token(p.type_k, p.type_v, swa=True),
        kv_cells_swa=m.swa_cells(n_ctx, p.n_ubatch, p.swa_full) if m.n_swa else 0,
        kv_bytes=kv, kv_gpu_bytes=kv_gpu, compute_bytes=compute,
        total_gpu_bytes=weights_gpu + kv_gpu + compute if gpu else 0, budget_bytes=budget,
        fits=n_ctx > 0 and _need(p, m, n_ctx, p.type_k, p.type_v) <= budget,
        max_ctx={t: largest_ctx(p, m, t, t if p.flash_attn or t == "f16" else "f16") for t in KV_TYPES},
    )


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
    raise ProfileError(f"{p.source}: needs {need / GIB:.2f} GiB of {where} at n_ctx {plan.n_ctx} "
                       f"({plan.type_k}/{plan.type_v} KV {plan.kv_bytes / GIB:.2f} GiB) but the budget is "
                       f"{plan.budget_bytes / GIB:.2f} GiB; largest that fits: {fix}")


def describe(plan: MemoryPlan) -> list[str]:
    """The plan as lines of text for `localchat plan` and /profile."""
    mib = lambda b: f"{b / (1 << 20):,.0f} MiB"  # noqa: E731
    kvt = f"{plan.type_k}/{plan.type_v}"
    lines = [
        f"model      {plan.model}",
        f"layers     {plan.layers_gpu} of {plan.layers_total} on GPU" if plan.gpu else "layers     all on CPU",
        f"weights    GPU {mib(plan.weights_gpu_bytes)}, CPU {mib(plan.weights_cpu_bytes)}",
        f"KV         {plan.kv_bytes_per_token:,} bytes/token ({kvt}) x {plan.n_ctx:,} tokens = {mib(plan.kv_bytes)}",
    ]
    if plan.kv_cells_swa:
        lines.append(f"           sliding-window layers ({plan.kv_bytes_per_token_swa:,} bytes/token) hold "
                     f"{plan.kv_cells_swa:,} cells")
    total = plan.total_gpu_bytes if plan.gpu else plan.weights_cpu_bytes + plan.kv_bytes + plan.compute_bytes
    lines += [
        f"compute    {mib(plan.compute_bytes)} (estimate)",
        f"total      {mib(total)} of {mib(plan.budget_bytes)} {'GPU budget' if plan.gpu else 'free RAM'}"
        f" -> {'fits' if plan.fits else 'DOES NOT FIT'}",
        "largest n_ctx that fits: " + ", ".join(f"{t} {c:,}" for t, c in plan.max_ctx.items()),
    ]
    return lines
