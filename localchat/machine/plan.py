"""The memory plan: everything the process puts on the card, against the profile's budget and
the memory actually free on the device.

Weights and KV are exact arithmetic from the GGUF (llama.cpp pads n_ctx to 256 and gives
sliding-window layers n_swa + n_ubatch cells). Compute buffers follow what llama.cpp reserves,
fitted to its own reports (CUDA with flash attention: the largest of the logits, the FFN section
with the KQ mask, and, for a quantized KV, the f16 copy of one layer's K and V); the CUDA context
and the backend's growth during the first prefill are measured constants (docs/MEMORY.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import psutil

from localchat.errors import ProfileError
from localchat.machine.models import ModelInfo
from localchat.machine.placement import Card, CardUse, kv_on, layer_devices
from localchat.settings import KV_TYPES, QUANTIZED, Profile

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
# ggml's scheduler with pipeline parallelism (a layer split over local GPUs, every layer offloaded) keeps
# this many copies of each device's graph inputs: the f16 KQ mask (one already counted) and the incoming
# activations (fitted on two H200s to 0.03% at n_ctx 8k, 16k, 32k, f16 and q8_0; docs/MEMORY.md)
PIPELINE_COPIES = 4
SMALL_BUFFERS = 8 * MIB  # small tensors and allocations besides the named buffers (measured 3-6 MiB)


def compute_slack(m: ModelInfo, p: Profile) -> int:
    """ggml's graph allocator can fragment past the largest section by about one FFN activation
    (measured: 30 MiB on the 7B shape at one n_ctx of ten): room kept for it on a GPU."""
    return min(p.n_ubatch, p.n_batch) * 4 * (m.n_ff + 2 * m.n_embd)


@dataclass(frozen=True)
class DevicePlan:
    """One device's row of the plan (`localchat plan --json`: `devices`)."""

    name: str
    endpoint: str  # an RPC device's server, "" for a local GPU
    layers: int  # repeating layers on it
    output: bool  # holds the output layer
    weights_bytes: int
    kv_bytes: int
    compute_bytes: int
    total_bytes: int  # all of the above plus the CUDA context, the prefill growth and slack
    room_bytes: int  # what it may take: its budget, or its free memory less the margin
    free_bytes: int  # free on it at start (0: not read)
    limited_by: str  # profile or free memory
    fits: bool
    from_profile: bool = False  # the profile's card as written, not read from this machine


@dataclass(frozen=True)
class MemoryPlan:
    """`localchat plan --json` prints this; its keys are documented in docs/profiles.md."""

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
    limited_by: str = "profile"  # what set the room (of the tightest device): profile, free memory
    split_mode: str = "none"  # how the model is spread over several devices: layer, row
    devices: list[DevicePlan] = field(default_factory=list)  # a row per device (GPU or RPC)
    shares: list[float] = field(default_factory=list)  # each device's share of the layers (tensor_split)
    host_bytes: int = 0  # in host RAM: weights_cpu_bytes, the KV of layers on the CPU, llama.cpp's host buffers
    host_room_bytes: int = 0  # RAM available at start (less a CPU profile's reserve_gb)
    projector_bytes: int = 0  # a vision projector's weights and encoder: in the first device's compute (or the CPU's)

    @property
    def host_fits(self) -> bool:
        return self.host_bytes <= self.host_room_bytes

    @property
    def host_kv_bytes(self) -> int:
        """The KV of the layers left on the CPU."""
        return self.kv_bytes - self.kv_gpu_bytes

    @property
    def host_buffer_bytes(self) -> int:
        """llama.cpp's buffers in host RAM (compute, staged graph inputs, HOST_OVERHEAD)."""
        return self.host_bytes - self.weights_cpu_bytes - self.host_kv_bytes

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ProfilePlans:
    """`localchat plan`: the plan the chat uses on this build and machine, and the plan for the cards the profile
    is written for (the same plan where the chat uses them; None for a profile without cards)."""

    chat: MemoryPlan
    card: MemoryPlan | None
    why_not_card: str = ""  # why the chat does not use the card plan (a build without GPU support)

    @property
    def chat_uses(self) -> str:
        """card: the chat uses the card plan; cpu: it runs on the CPU; rpc: on RPC servers' devices alone."""
        if self.card is not None and self.chat is self.card:
            return "card"
        return "rpc" if self.chat.gpu else "cpu"

    def to_json(self) -> dict:
        """The chat's plan (its keys unchanged), the card plan in the same shape, and which the chat uses."""
        card = self.card.to_json() if self.card is not None else None
        return {**self.chat.to_json(), "card_plan": card, "chat_uses": self.chat_uses}


def _layers_on_gpu(p: Profile, m: ModelInfo) -> int:
    if p.n_gpu_layers < 0:
        return m.n_layer + 1
    return min(p.n_gpu_layers, m.n_layer + 1)


def _compute_bytes(m: ModelInfo, p: Profile, n_ctx: int, type_k: str, gpu: bool, logits_here: bool = True) -> int:
    ub = min(p.n_ubatch, p.n_batch)
    logits = ub * 4 * (m.n_vocab + m.n_embd) if logits_here else 0
    if not p.flash_attn:  # the attention scores of a whole ubatch are materialized
        return ub * 4 * (m.n_vocab + 4 * m.n_embd + 2 * m.n_ff) + ub * n_ctx * m.n_head * 4
    if not gpu:
        return logits + ub * 4 * m.n_embd  # measured on the CPU backend: logits + two embedding rows
    ffn = ub * 4 * 3 * (m.n_ff + m.n_embd) + ub * 2 * n_ctx  # with the f16 KQ mask
    # a quantized KV is converted to f16 for the flash-attention kernel, one layer's K and V at a time
    kv_width = 2 * max((k + v for k, v in m.kv_widths()), default=0)
    converted = ub * 4 * 4 * m.n_embd + n_ctx * (ub * 2 + kv_width) if type_k in QUANTIZED else 0
    return max(logits, ffn, converted)


def _remote_compute(m: ModelInfo, p: Profile, n_ctx: int, output: bool) -> int:
    """An RPC device's compute buffers, enough for a CPU or a CUDA server (fitted above what CPU servers
    reserved: the logits where the output layer is, twice the FFN section, f32 attention scores)."""
    ub = min(p.n_ubatch, p.n_batch)
    return (ub * 4 * (m.n_vocab + m.n_embd) if output else 0) + 2 * ub * 4 * 3 * (m.n_ff + m.n_embd) + ub * 8 * n_ctx


def _on_gpu(p: Profile) -> bool:
    return p.offloads and (p.vram_gb > 0 or bool(p.rpc_servers))


def budget_bytes(p: Profile) -> int:
    if p.vram_gb > 0:
        return int((p.vram_gb - p.reserve_gb) * GIB)
    return ram_budget(p)


def ram_budget(p: Profile) -> int:
    """The RAM a plan may take: what is available now, less reserve_gb on a CPU profile (a GPU profile's
    reserve_gb is the desktop's share of the card)."""
    reserve = 0.0 if p.vram_gb > 0 else p.reserve_gb
    return int(psutil.virtual_memory().available - reserve * GIB)


def card_room(p: Profile, card: Card) -> tuple[int, str]:
    """What one device's share of the plan may reach, and what set it: the profile's budget, or the memory
    free on it now (read after our CUDA context was made, hence added back) less the margin."""
    if not card.local:
        return card.budget, "free memory"  # an RPC device: what its server has free, less the margin
    if not card.free:
        return card.budget, "profile"
    by_free = card.free - int(p.free_margin_gb * GIB) + CUDA_CONTEXT
    return (by_free, "free memory") if by_free < card.budget else (card.budget, "profile")


def default_cards(p: Profile, free: int = 0) -> list[Card]:
    """The profile's GPUs as it describes them (`free`: read on the first), before any device is read."""
    if not (_on_gpu(p) and p.vram_gb > 0):
        return []
    if p.split_mode == "none" or p.gpus == 1:
        return [Card(f"CUDA{p.main_gpu}", budget_bytes(p), free, from_profile=True)]
    return [Card(f"CUDA{i}", budget_bytes(p), free if i == 0 else 0, from_profile=True) for i in range(p.gpus)]


def shares(p: Profile, cards: list[Card]) -> list[float]:
    """Each device's share of the layers: the profile's tensor_split, else each device's room."""
    if p.tensor_split and len(p.tensor_split) == len(cards):
        return [float(s) for s in p.tensor_split]
    rooms = [max(card_room(p, c)[0], 0) for c in cards]
    return [float(r) for r in rooms] if any(rooms) else [1.0] * len(cards)


def _uses(p: Profile, m: ModelInfo, cards: list[Card], n_ctx: int, type_k: str, type_v: str) -> list[CardUse]:
    if not cards:
        return []
    split = shares(p, cards)
    where = layer_devices(m.n_layer, p.n_gpu_layers, split)
    cells = m.swa_cells(n_ctx, p.n_ubatch, p.swa_full) if m.n_swa else n_ctx
    pipeline = len(cards) > 1 and p.split_mode == "layer" and all(c.local for c in cards) and None not in where
    offloaded = sum(m.layer_bytes[i] for i in range(m.n_layer) if where[i] is not None) + (
        m.output_bytes if where[m.n_layer] is not None else 0)
    out = []
    for d, card in enumerate(cards):
        mine = [i for i in range(m.n_layer) if where[i] == d]
        output = where[m.n_layer] == d
        if p.split_mode == "row":  # each matrix's rows spread by the shares; the KV stays with the layer
            weights = round(offloaded * split[d] / sum(split))
        else:
            weights = sum(m.layer_bytes[i] for i in mine) + (m.output_bytes if output else 0)
        if not (mine or output):
            compute = 0
        elif card.local:
            compute = _compute_bytes(m, p, n_ctx, type_k, True, logits_here=output or len(cards) == 1)
        else:  # the server's backend is not told: planned as a CPU one, which holds about twice the FFN
            compute = _remote_compute(m, p, n_ctx, output)
        if compute and pipeline:
            ub = min(p.n_ubatch, p.n_batch)
            compute += (PIPELINE_COPIES - 1) * ub * 2 * n_ctx + PIPELINE_COPIES * ub * 4 * m.n_embd
        if d == 0:  # libmtmd puts a vision projector on the first device
            compute += m.projector_bytes
        kv = kv_on(m, mine, n_ctx, type_k, type_v, cells, p.flash_attn)
        out.append(CardUse(card.name, len(mine), output, weights, kv, compute))
    return out


def tied_output(m: ModelInfo) -> bool:
    """The output projection is the token embedding itself (no output.weight): llama.cpp then loads it twice, on
    the output layer's device and on the CPU, where the input layer always stays (llama-model.cpp, dev_input).
    Told by size: besides the layers and the output, an untied model holds the token embedding (the output's
    shape, more than a sixteenth of its bytes at any quantization), a tied one only a norm or two."""
    rest = m.tensor_bytes - sum(m.layer_bytes) - m.output_bytes
    return m.output_bytes > 0 and rest < m.output_bytes // 16


def _host_buffers(p: Profile, m: ModelInfo, uses: list[CardUse], n_ctx: int, type_k: str) -> int:
    """llama.cpp's buffers in host RAM: the CPU backend's compute buffer where layers stay on the CPU (with the
    logits where the output does), the graph inputs staged for the devices (a ubatch's embeddings and the KQ mask:
    CUDA_Host, fitted to the H200 runs within 0.01%, docs/data/gpu/memory-calibration.jsonl) and HOST_OVERHEAD."""
    ub = min(p.n_ubatch, p.n_batch)
    output_offloaded = any(u.output for u in uses)
    layers_on_cpu = sum(u.layers for u in uses) < m.n_layer or not output_offloaded
    cpu = _compute_bytes(m, p, n_ctx, type_k, False, logits_here=not output_offloaded) if layers_on_cpu else 0
    mask = (2 if p.flash_attn else 4) * ub * n_ctx  # f16 with flash attention, f32 without
    staged = ub * 8 * m.n_embd + mask if uses else 0
    return cpu + staged + HOST_OVERHEAD + (0 if uses else m.projector_bytes)  # a projector without a device


def _host_parts(p: Profile, m: ModelInfo, uses: list[CardUse], n_ctx: int, type_k: str,
                type_v: str) -> tuple[int, int, int]:
    """What stays in host RAM: the weights not offloaded (the token embedding always, and a tied output's copy
    that went to a device besides), the KV of the layers left on the CPU, and llama.cpp's host buffers."""
    offloaded = sum(u.weights for u in uses)
    copy = m.output_bytes if any(u.output for u in uses) and tied_output(m) else 0
    kv = m.kv_bytes(n_ctx, type_k, type_v, p.n_ubatch, p.swa_full, p.flash_attn) - sum(u.kv for u in uses)
    return m.tensor_bytes - offloaded + copy, max(kv, 0), _host_buffers(p, m, uses, n_ctx, type_k)


def _card_need(p: Profile, m: ModelInfo, card: Card, use: CardUse) -> int:
    fixed = CUDA_CONTEXT + PREFILL_GROWTH if card.local else 0
    busy = compute_slack(m, p) + SMALL_BUFFERS if use.compute else 0
    return use.weights + use.kv + use.compute + busy + fixed


def _fits_all(p: Profile, m: ModelInfo, cards: list[Card], n_ctx: int, type_k: str, type_v: str) -> bool:
    """Every device holds its share, and host RAM what stays on the CPU (all of it without a device)."""
    uses = _uses(p, m, cards, n_ctx, type_k, type_v)
    if sum(_host_parts(p, m, uses, n_ctx, type_k, type_v)) > ram_budget(p):
        return False
    return all(_card_need(p, m, c, u) <= card_room(p, c)[0] for c, u in zip(cards, uses))


def largest_ctx(p: Profile, m: ModelInfo, type_k: str, type_v: str, free: int = 0,
                cards: list[Card] | None = None) -> int:
    """Largest multiple of 256 that fits every device, capped by the trained context (0: none)."""
    cards = default_cards(p, free) if cards is None else cards
    cap = m.n_ctx_train or 1 << 17
    lo, hi = 0, cap // CTX_STEP
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits_all(p, m, cards, mid * CTX_STEP, type_k, type_v):
            lo = mid
        else:
            hi = mid - 1
    return lo * CTX_STEP


def make_plan(p: Profile, m: ModelInfo, n_ctx: int | None = None, free: int = 0,
              cards: list[Card] | None = None) -> MemoryPlan:
    """The plan at the profile's n_ctx (or the largest that fits every device, for auto). `cards`: the
    devices read at start; without them the profile's own GPUs, `free` read on the first (0: not read)."""
    cards = (default_cards(p, free) if cards is None else cards) if _on_gpu(p) else []
    if n_ctx is None:
        n_ctx = largest_ctx(p, m, p.type_k, p.type_v, cards=cards) if p.n_ctx == "auto" else int(p.n_ctx)
    n_ctx = -(-n_ctx // CTX_STEP) * CTX_STEP  # llama.cpp pads the context to 256
    kv = m.kv_bytes(n_ctx, p.type_k, p.type_v, p.n_ubatch, p.swa_full, p.flash_attn)
    uses = _uses(p, m, cards, n_ctx, p.type_k, p.type_v)
    rows = _device_rows(p, m, cards, uses)
    gpu, local = bool(cards), sum(c.local for c in cards)
    weights_gpu = sum(u.weights for u in uses)
    compute = sum(u.compute for u in uses) if gpu else _compute_bytes(m, p, n_ctx, p.type_k, False) + m.projector_bytes
    host_weights, host_kv, host_buffers = _host_parts(p, m, uses, n_ctx, p.type_k, p.type_v)
    host, ram = host_weights + host_kv + host_buffers, ram_budget(p)
    tight = next((r for r in rows if not r.fits), min(rows, key=lambda r: r.room_bytes - r.total_bytes, default=None))
    return MemoryPlan(
        model=str(m.path), profile=p.name, gpu=gpu, n_ctx=n_ctx, n_ctx_train=m.n_ctx_train,
        type_k=p.type_k, type_v=p.type_v, layers_total=m.n_layer + 1,
        layers_gpu=_layers_on_gpu(p, m) if gpu else 0,
        weights_gpu_bytes=weights_gpu, weights_cpu_bytes=host_weights,
        kv_bytes_per_token=m.kv_bytes_per_token(p.type_k, p.type_v, flash_attn=p.flash_attn),
        kv_bytes_per_token_swa=m.kv_bytes_per_token(p.type_k, p.type_v, swa=True, flash_attn=p.flash_attn),
        kv_cells_swa=m.swa_cells(n_ctx, p.n_ubatch, p.swa_full) if m.n_swa else 0,
        kv_bytes=kv, kv_gpu_bytes=sum(u.kv for u in uses), compute_bytes=compute,
        total_gpu_bytes=sum(r.total_bytes for r in rows),
        budget_bytes=sum(c.budget for c in cards) if gpu else ram,
        fits=n_ctx > 0 and host <= ram and all(r.fits for r in rows),
        max_ctx={t: largest_ctx(p, m, t, t if p.flash_attn or t == "f16" else "f16", cards=cards) for t in KV_TYPES},
        cuda_context_bytes=CUDA_CONTEXT * local, prefill_growth_bytes=PREFILL_GROWTH * local,
        device_free_bytes=sum(c.free for c in cards), free_margin_bytes=int(p.free_margin_gb * GIB) if gpu else 0,
        limited_by=tight.limited_by if tight else "profile", split_mode=p.split_mode if len(cards) > 1 else "none",
        devices=rows, shares=shares(p, cards) if cards else [], host_bytes=host, host_room_bytes=ram,
        projector_bytes=m.projector_bytes,
    )


def _device_rows(p: Profile, m: ModelInfo, cards: list[Card], uses: list[CardUse]) -> list[DevicePlan]:
    rows = []
    for card, use in zip(cards, uses):
        need, (room, why) = _card_need(p, m, card, use), card_room(p, card)
        rows.append(DevicePlan(card.name, card.endpoint, use.layers, use.output, use.weights, use.kv, use.compute,
                               need, room, card.free, why, need <= room, card.from_profile))
    return rows


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def check_fits(plan: MemoryPlan, p: Profile) -> None:
    """Stop before loading when the plan does not fit, with the numbers and the fix."""
    if plan.n_ctx_train and plan.n_ctx > plan.n_ctx_train:
        raise ProfileError(f"{p.source}: n_ctx {plan.n_ctx} is above the model's trained context "
                           f"({plan.n_ctx_train}); set n_ctx: {plan.n_ctx_train} or less (or auto)")
    if plan.fits:
        return
    best = ", ".join(f"{t}: n_ctx {c}" for t, c in plan.max_ctx.items() if c)
    if plan.gpu and not plan.host_fits and all(d.fits for d in plan.devices):
        raise _host_refusal(plan, p, best or "more n_gpu_layers or a smaller model")
    fix = best or "a smaller model or fewer n_gpu_layers"
    if len(plan.devices) > 1:
        d = next(r for r in plan.devices if not r.fits)
        room = "what is free there now, less the margin" if d.limited_by == "free memory" else "its budget"
        raise ProfileError(f"{p.source}: {d.name} needs {_gib(d.total_bytes)} at n_ctx {plan.n_ctx} "
                           f"({d.layers} layers, {plan.type_k}/{plan.type_v} KV {_gib(d.kv_bytes)}) but its room is "
                           f"{_gib(d.room_bytes)} ({room}); largest that fits every device: {fix}")
    need = plan.total_gpu_bytes if plan.gpu else plan.host_bytes
    where = "GPU memory" if plan.gpu else "free RAM"
    if plan.limited_by == "free memory":
        room = (f"only {_gib(plan.device_free_bytes)} is free on the card now (plus {_gib(plan.cuda_context_bytes)} "
                f"of our own CUDA context, less a {_gib(plan.free_margin_bytes)} margin)")
    else:
        room = f"the budget is {_gib(plan.budget_bytes)}"
    raise ProfileError(f"{p.source}: needs {_gib(need)} of {where} at n_ctx {plan.n_ctx} "
                       f"({plan.type_k}/{plan.type_v} KV {_gib(plan.kv_bytes)}) but {room}; largest that fits: {fix}")


def _host_refusal(plan: MemoryPlan, p: Profile, fix: str) -> ProfileError:
    """The cards hold their share but host RAM cannot take what stays on the CPU: the sum, part by part."""
    return ProfileError(
        f"{p.source}: needs {_gib(plan.host_bytes)} of host RAM at n_ctx {plan.n_ctx}: the weights left on the CPU "
        f"{_gib(plan.weights_cpu_bytes)} ({plan.layers_total - plan.layers_gpu} of {plan.layers_total} layers, the "
        f"token embedding) + their KV {_gib(plan.host_kv_bytes)} + llama.cpp's host buffers "
        f"{_gib(plan.host_buffer_bytes)}, but {_gib(plan.host_room_bytes)} is available; largest that fits: {fix}")
