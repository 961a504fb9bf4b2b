"""The memory plan as text: `localchat plan` and /profile, with llama.cpp's own figures beside it."""

from __future__ import annotations

from localchat.machine.plan import MIB, MemoryPlan, ProfilePlans


def describe_plans(plans: ProfilePlans) -> list[str]:
    """`localchat plan`: where the chat would not use the profile's cards (a build without GPU support), the plan
    for those cards first, marked as such, then why and the plan the chat uses instead."""
    if plans.card is None or plans.chat_uses == "card":
        return describe(plans.chat)
    assumed = [d.name for d in plans.card.devices if d.from_profile]
    head = (f"card plan  for the profile's {'card' if len(assumed) == 1 else 'cards'} {', '.join(assumed)} as written, "
            "not read from this machine (free memory unknown: vram_gb less reserve_gb taken as free)")
    return [head, *describe(plans.card), f"this build: {plans.why_not_card}",
            "chat plan  what the chat uses on this build", *describe(plans.chat, with_model=False)]


def describe(plan: MemoryPlan, allocated: dict[str, dict[str, int]] | None = None,
             with_model: bool = True) -> list[str]:
    """The plan as lines of text for `localchat plan` and /profile; `allocated`: llama.cpp's own
    buffer sizes once the model is loaded (Engine.buffers), shown beside the plan's."""
    mib = lambda b: f"{b / MIB:,.0f} MiB"  # noqa: E731
    many = len(plan.devices) > 1
    dev = plan.devices[0].name if plan.devices else "CPU"

    def said(kind: str) -> str:
        have = (allocated or {}).get(kind, {})
        return f" (llama.cpp: {mib(have[dev])})" if dev in have else ""

    kvt = f"{plan.type_k}/{plan.type_v}"
    lines = [f"model      {plan.model}"] if with_model else []
    lines += [
        f"layers     {plan.layers_gpu} of {plan.layers_total} on {'the devices below' if many else dev}"
        if plan.gpu else "layers     all on CPU",
        f"weights    GPU {mib(plan.weights_gpu_bytes)}, CPU {mib(plan.weights_cpu_bytes)}" + said("model"),
        f"KV         {plan.kv_bytes_per_token:,} bytes/token ({kvt}) x {plan.n_ctx:,} tokens = {mib(plan.kv_bytes)}"
        + said("KV"),
    ]
    if many:
        lines += device_lines(plan, allocated)
    if plan.kv_cells_swa:
        lines.append(f"           sliding-window layers ({plan.kv_bytes_per_token_swa:,} bytes/token) hold "
                     f"{plan.kv_cells_swa:,} cells")
    lines.append(f"compute    {mib(plan.compute_bytes)}" + said("compute"))
    if plan.projector_bytes:
        lines.append(f"           of which the vision projector {mib(plan.projector_bytes)} on {dev} (its weights and "
                     "one image's encoder buffers)")
    if plan.gpu:
        other = plan.total_gpu_bytes - plan.weights_gpu_bytes - plan.kv_gpu_bytes - plan.compute_bytes
        lines.append(f"CUDA       context {mib(plan.cuda_context_bytes)}, growth during prefill "
                     f"{mib(plan.prefill_growth_bytes)}, allocator slack and small buffers "
                     f"{mib(other - plan.cuda_context_bytes - plan.prefill_growth_bytes)} (docs/MEMORY.md)")
    total = plan.total_gpu_bytes if plan.gpu else plan.weights_cpu_bytes + plan.kv_bytes + plan.compute_bytes
    # a card plan's host RAM has its own line
    fits = plan.n_ctx > 0 and all(d.fits for d in plan.devices) if plan.gpu else plan.fits
    lines.append(f"total      {mib(total)} of {mib(plan.budget_bytes)} {'GPU budget' if plan.gpu else 'free RAM'}"
                 f" -> {'fits' if fits else 'DOES NOT FIT'}")
    if plan.gpu:
        lines.append(host_line(plan))
    if plan.device_free_bytes:
        where = f"over {len(plan.devices)} devices" if many else "on the card"
        lines.append(f"free now   {mib(plan.device_free_bytes)} {where} (less {mib(plan.free_margin_bytes)} margin "
                     f"each): the {plan.limited_by} sets the room" + (" of the tightest" if many else ""))
    lines.append("largest n_ctx that fits: " + ", ".join(f"{t} {c:,}" for t, c in plan.max_ctx.items()))
    return lines


def host_line(plan: MemoryPlan) -> str:
    """What a plan with devices leaves in host RAM, part by part, against the RAM available."""
    mib = lambda b: f"{b / MIB:,.0f}"  # noqa: E731
    return (f"host RAM   {mib(plan.host_bytes)} MiB of {mib(plan.host_room_bytes)} MiB free "
            f"-> {'fits' if plan.host_fits else 'DOES NOT FIT'} (weights {mib(plan.weights_cpu_bytes)}, "
            f"KV {mib(plan.host_kv_bytes)}, llama.cpp's host buffers {mib(plan.host_buffer_bytes)})")


def device_lines(plan: MemoryPlan, allocated: dict[str, dict[str, int]] | None = None) -> list[str]:
    """A row per device of a split plan, with what llama.cpp allocated there once loaded."""
    mib = lambda b: f"{b / MIB:,.0f}"  # noqa: E731
    lines = [f"devices    split by {plan.split_mode}: each device's weights, KV and compute buffers in MiB"]
    for d in plan.devices:
        # llama.cpp names an RPC device's buffers RPC<n>[host:port], n counted on its server
        had = {k: sum(b for name, b in v.items() if name == d.name or (d.endpoint and name.endswith(f"[{d.endpoint}]")))
               for k, v in (allocated or {}).items() if k in ("model", "KV", "compute")}
        had = {k: b for k, b in had.items() if b}
        said = f" (llama.cpp: {', '.join(f'{k} {mib(v)}' for k, v in had.items())})" if had else ""
        where = f" at {d.endpoint}" if d.endpoint else ""
        lines.append(f"  {d.name:<8} {d.layers} layers{' + output' if d.output else ''}{where}: weights "
                     f"{mib(d.weights_bytes)}, KV {mib(d.kv_bytes)}, compute {mib(d.compute_bytes)}; total "
                     f"{mib(d.total_bytes)} of {mib(d.room_bytes)} ({d.limited_by}){said}"
                     f"{'' if d.fits else ' DOES NOT FIT'}")
    return lines
