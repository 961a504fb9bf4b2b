"""Composition: profile + model + memory plan -> engine -> chat session (and its store)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from localchat.chat import attaching
from localchat.chat.turns import Chat, ChatSettings
from localchat.chatformat.templates import ChatFormat, template_problem
from localchat.engine import (
    Device,
    DraftModel,
    Engine,
    EngineConfig,
    LazyEmbedder,
    SamplingConfig,
    check_vocab,
    devices,
    gpu_offload_supported,
    register_rpc,
    row_split_supported,
    rpc_supported,
)
from localchat.engine.vision import Projector
from localchat.errors import ModelError, ProfileError, TemplateFailure
from localchat.machine import models, profiles, rpc
from localchat.machine import plan as planmod
from localchat.machine.fetch import EMBEDDING_MODELS, ensure_builtin
from localchat.machine.models import ModelInfo
from localchat.machine.placement import Card
from localchat.machine.plan import MemoryPlan
from localchat.machine.projector import QWEN_VL, find_beside, image_token_cap, projector_info
from localchat.machine.threads import ThreadFit
from localchat.settings import SETTING_KEYS, Profile, thread_count

log = logging.getLogger(__name__)

CUDA_INSTALL = ('CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir '
                '"llama-cpp-python>=0.3.36,<0.4"')
RPC_INSTALL = CUDA_INSTALL.replace("-DGGML_CUDA=on", "-DGGML_RPC=on")

Report = Callable[[str], None]
DRAFT_COMPUTE = 256 << 20  # a small draft model's compute buffers, rounded up


@dataclass
class Runtime:
    profile: Profile
    model: ModelInfo
    plan: MemoryPlan
    engine: Engine
    chat: Chat
    gpu_warning: str = ""
    threads: ThreadFit | None = None  # the profile's thread settings and, for auto, the load readings
    threads_why: str = ""  # how auto chose the threads in use
    draft: DraftModel | None = None  # the profile's draft_model, loaded beside the model
    embedding: LazyEmbedder | None = None  # the profile's embedding_model, loaded on its first use
    projector: Projector | None = None  # the model's vision projector (mmproj), where it has one
    requested: Profile | None = None  # the profile as asked for, before it was fitted to the model and build

    def refit_threads(self, min_window: float = 0.0, fresh: float = 0.0) -> None:
        """Auto threads: as many as the cores other processes leave free now (two reads of /proc; none
        where the last reading is younger than `fresh` seconds)."""
        if self.threads is None or not self.threads.auto:  # fixed numbers: nothing to refit
            return
        choice = self.threads.choose(min_window, fresh)
        self.threads_why = choice.why
        if (choice.decode, choice.batch) != self.engine.threads:
            log.info("threads %s -> %d/%d (%s)", self.engine.threads, choice.decode, choice.batch, choice.why)
            self.engine.set_threads(choice.decode, choice.batch)

    @property
    def all_on_gpu(self) -> bool:
        """Every layer (the output's too) on a GPU or a remote device: llama.cpp's CPU threads have next to nothing
        to do in a turn."""
        return self.plan.gpu and self.plan.layers_gpu >= self.plan.layers_total

    def rescan_children(self) -> None:
        """Auto threads: this process's children looked for again (between turns: it scans every process)."""
        if self.threads is not None and self.threads.gauge is not None:
            self.threads.gauge.rescan()

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token takes in this context's KV cache (all layers, its K and V types)."""
        c = self.engine.config
        return self.model.kv_bytes_per_token(c.type_k, c.type_v, flash_attn=c.flash_attn)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()
        if self.projector is not None:
            self.projector.close()
        self.engine.close()


def load_profile(name: str | None, overrides: dict[str, Any]) -> Profile:
    return profiles.with_overrides(profiles.load(name or "cpu"), **overrides)


def resolve_model(profile: Profile, report: Report) -> ModelInfo:
    """The profile's model, read (and described even where llama.cpp would refuse it); metadata it
    ignores is said once."""
    info = models.model_info(models.resolve(profile.model, report))
    if info.embeds_only:
        raise ModelError(f"{info.path.name} is an embedding model: it makes sentence vectors, not replies; "
                         "give it as embedding_model (search by meaning) and a chat model as model")
    for notice in info.notices:
        report(f"localchat: {info.path.name}: {notice}")
    return info


def local_gpus() -> list[Device]:
    """This machine's GPUs as llama.cpp numbers them (CUDA0, ...), RPC servers' devices left out."""
    return [d for d in devices() if d.kind == "gpu" and not d.name.startswith("RPC")]


def effective_profile(profile: Profile) -> tuple[Profile, str]:
    """Without a GPU build, offloading does nothing: plan for the CPU and say so once. RPC servers need a
    build with the RPC backend: stop with the install command."""
    if profile.offloads and profile.rpc_servers and not rpc_supported():
        raise ProfileError(f"{profile.source}: rpc_servers need llama-cpp-python built with the RPC backend: "
                           f"{RPC_INSTALL}")
    if not (profile.offloads and profile.vram_gb > 0) or (gpu_offload_supported() and local_gpus()):
        return profile, ""
    if profile.rpc_servers:  # the layers go to the RPC servers' devices alone
        return replace(profile, vram_gb=0.0, reserve_gb=0.0), (
            f"profile '{profile.name}' names GPUs but this machine has none llama.cpp can use; "
            f"the layers go to the RPC servers alone. The CUDA build: {CUDA_INSTALL}")
    warning = (f"profile '{profile.name}' offloads layers but this llama-cpp-python has no GPU support; "
               f"running on the CPU. Install the CUDA build: {CUDA_INSTALL}")
    return replace(profile, n_gpu_layers=0, vram_gb=0.0, reserve_gb=0.0), warning


def cards_for(profile: Profile) -> list[Card]:
    """The devices the profile spreads the model over, read now: each RPC server's devices (checked,
    asked for their free memory; llama.cpp puts them first) and then the profile's GPUs."""
    if not profile.offloads:
        return []
    margin = int(profile.free_margin_gb * planmod.GIB)
    remote = []
    for endpoint in profile.rpc_servers:
        rpc.check_address(endpoint, profile.rpc_public)
        remote += rpc.probe(endpoint)
    cards = [Card(f"RPC{i}", max(d.free - margin, 0), d.free, local=False, endpoint=d.endpoint)
             for i, d in enumerate(remote)]
    if profile.vram_gb <= 0:
        return cards
    gpus, budget = local_gpus(), planmod.budget_bytes(profile)
    want = 1 if profile.split_mode == "none" else profile.gpus
    first = profile.main_gpu if want == 1 else 0
    if first + want > len(gpus):
        have = ", ".join(f"{d.name} ({d.description})" for d in gpus) or "none"
        raise ProfileError(f"{profile.source}: the profile uses {want} GPU(s) from CUDA{first}, this machine has "
                           f"{len(gpus)}: {have}; set gpus (or main_gpu) to what is there")
    if profile.split_mode == "row" and want > 1 and not row_split_supported():
        raise ProfileError(f"{profile.source}: split_mode: row needs the CUDA backend's split buffers, which the "
                           f"llama.cpp of this llama-cpp-python no longer has (llama-bench -sm row fails alike); "
                           f"use split_mode: layer")
    return cards + [Card(d.name, budget, d.free) for d in gpus[first:first + want]]


def plans_for_command(profile: Profile, info: ModelInfo) -> tuple[Profile, planmod.ProfilePlans]:
    """`localchat plan`: the profile as the chat would run it here, the plan it would use, and the plan for the
    cards the profile is written for; where this build or machine cannot use them, those cards as the profile
    writes them (beside the RPC servers' devices, read), whatever the build."""
    chat_profile, why = effective_profile(profile)
    info, _ = with_projector(chat_profile, info)
    cards = cards_for(chat_profile)
    chat = planmod.make_plan(chat_profile, info, cards=cards)
    if not why:
        return chat_profile, planmod.ProfilePlans(chat, chat if chat.gpu else None)
    written = [c for c in cards if not c.local] + planmod.default_cards(profile)
    return chat_profile, planmod.ProfilePlans(chat, planmod.make_plan(profile, info, cards=written), why)


def fit_trained_context(profile: Profile, info: ModelInfo, explicit_ctx: bool, report: Report) -> Profile:
    """A profile describes a card and models vary: its n_ctx above the model's trained context becomes
    the trained one, said in one line. An n_ctx given on the command line stays an error (check_fits)."""
    if not isinstance(profile.n_ctx, int) or not info.n_ctx_train or profile.n_ctx <= info.n_ctx_train:
        return profile
    if explicit_ctx:
        raise ProfileError(f"--ctx {profile.n_ctx} is above the trained context of {info.name} "
                           f"({info.n_ctx_train}); use --ctx {info.n_ctx_train} or less")
    report(f"localchat: profile '{profile.name}' sets n_ctx {profile.n_ctx}, above the trained context of "
           f"{info.name} ({info.n_ctx_train}): using {info.n_ctx_train}")
    return replace(profile, n_ctx=info.n_ctx_train)


def plan_for(profile: Profile, info: ModelInfo, report: Report | None = None) -> MemoryPlan:
    """The memory plan against the profile and the memory free on the card now; stops before
    loading when it does not fit, and says when the free memory, not the profile, set the context."""
    plan = planmod.make_plan(profile, info, cards=cards_for(profile))
    planmod.check_fits(plan, profile)
    if report and plan.limited_by == "free memory" and profile.n_ctx == "auto":
        report(f"localchat: {plan.device_free_bytes / (1 << 30):.2f} GiB free on the card, less than the profile's "
               f"{plan.budget_bytes / (1 << 30):.2f} GiB budget, set the context: n_ctx {plan.n_ctx}")
    return plan


def engine_config(profile: Profile, info: ModelInfo, n_ctx: int, verbose: bool, cores: int = 0,
                  plan: MemoryPlan | None = None, sequences: int = 2) -> EngineConfig:
    """`cores`: the thread count auto starts from (0: every logical CPU); `plan`: the devices it placed
    the model on (without one, llama.cpp's own choice); `sequences`: llama.cpp sequences sharing the context's
    cells (the server parks conversations in them; the last is a spare, as EngineConfig's). The settings of the
    same name are the profile's."""
    cards = [d.name for d in plan.devices] if plan and plan.gpu else []
    split = plan.shares if plan and len(cards) > 1 else []
    main = cards.index(f"CUDA{profile.main_gpu}") if profile.split_mode == "row" and len(cards) > 1 else 0
    return EngineConfig(
        **_same_named(profile, EngineConfig, skip=("n_ctx", "n_threads", "n_threads_batch", "split_mode",
                                                   "tensor_split", "main_gpu")),
        devices=tuple(cards), split_mode=profile.split_mode if len(cards) > 1 else "none",
        tensor_split=tuple(split), main_gpu=main, model_path=str(info.path), n_ctx=n_ctx,
        n_threads=thread_count(profile.n_threads) or cores,
        n_threads_batch=thread_count(profile.n_threads_batch) or cores, verbose=verbose,
        pinned_bytes=pinned_bytes(plan), sequences=sequences)


def pinned_bytes(plan: MemoryPlan | None) -> int:
    """A pinned host buffer for the KV's state copies where the model runs on a GPU: the whole KV and
    room for llama.cpp's state layout, kept only where host RAM has twice that to spare after the plan."""
    if plan is None or not plan.gpu:
        return 0
    size = plan.kv_bytes + plan.kv_bytes // 64 + (16 << 20)
    return size if plan.host_room_bytes - plan.host_bytes >= 2 * size else 0


def _same_named(profile: Profile, target: type, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The profile's settings that `target` (a dataclass) has a field of the same name for."""
    return {f.name: getattr(profile, f.name) for f in dataclasses.fields(target)
            if f.name in SETTING_KEYS and f.name not in skip}


def chat_settings(profile: Profile) -> ChatSettings:
    seed = profile.seed if profile.seed >= 0 else 0xFFFFFFFF  # llama.cpp's "random seed"
    sampling = SamplingConfig(**_same_named(profile, SamplingConfig, skip=("seed",)), seed=seed)
    return ChatSettings(**_same_named(profile, ChatSettings), sampling=sampling)


def chat_format(engine: Engine, has_template: bool = True) -> ChatFormat:
    """The model's chat template, probed at load: a template that is not UTF-8, breaks a bound or
    the sandbox stops the chat here, naming the model file. `has_template` False: the file's template is
    not text (said when the model was read) and the fallback format serves."""
    name = Path(engine.config.model_path).name
    raw = engine.meta_bytes("tokenizer.chat_template") if has_template else None
    try:
        template = raw.decode("utf-8") if raw is not None else None
    except UnicodeDecodeError:
        raise TemplateFailure(f"{name}: {template_problem(None, invalid_utf8=True)}; use another GGUF",
                              "bound") from None
    try:
        return ChatFormat(template, engine.special_text("bos"), engine.special_text("eos"))
    except TemplateFailure as exc:
        raise TemplateFailure(f"{name}: {exc}", exc.kind) from None
    except ModelError as exc:
        raise ModelError(f"{name}: {exc}") from None


def draft_need(profile: Profile, plan: MemoryPlan, report: Report) -> tuple[ModelInfo, int, int]:
    """The draft model, the bytes it takes beside the plan (its weights, an f16 KV of the same n_ctx, its
    compute buffers) and the room the plan leaves on the card (0 on a CPU profile: no card to fit)."""
    info = models.model_info(models.resolve(profile.draft_model, report))
    info.check_loadable()
    kv = info.kv_bytes(plan.n_ctx, "f16", "f16", profile.n_ubatch, profile.swa_full, profile.flash_attn)
    need = info.file_size + kv + DRAFT_COMPUTE
    room = sum(d.room_bytes - d.total_bytes for d in plan.devices)
    return info, need, room


def embedding_for(profile: Profile, report: Report, threads: int = 1) -> LazyEmbedder | None:
    """The profile's embedding model, checked (a damaged or missing file is one line) but not loaded yet;
    one thread where it embeds beside a chat (on an idle thread), more where the user waits for it."""
    spec = profile.embedding_model
    if not spec:
        return None
    path = ensure_builtin(spec, report) if spec in EMBEDDING_MODELS else models.resolve(spec, report)
    models.model_info(path).check_loadable()
    return LazyEmbedder(str(path), threads)


def projector_path(profile: Profile, info: ModelInfo) -> Path | None:
    """The profile's vision projector: named, found beside the model (auto), or none (off)."""
    if profile.mmproj == "off":
        return None
    if profile.mmproj == "auto":
        return find_beside(info.path)
    path = Path(profile.mmproj).expanduser()
    if not path.is_file():
        raise ModelError(f"mmproj {profile.mmproj}: no such file")
    return path


def with_projector(profile: Profile, info: ModelInfo) -> tuple[ModelInfo, str]:
    """The model as the plan counts it and the chat loads it: with the vision projector beside it, read and
    checked once; and why a projector found beside it is left out ("" where none is). One the profile names
    must pass the checks."""
    path = projector_path(profile, info)
    if path is None:
        return info, ""
    try:
        found = projector_info(path)
    except ModelError as exc:
        if profile.mmproj != "auto":
            raise
        return info, str(exc)
    return replace(info, projector=path, projector_bytes=found.total_bytes, projector_kind=found.kind), ""


def open_projector(profile: Profile, info: ModelInfo, left_out: str, engine: Engine,
                   report: Report) -> tuple[Projector | None, str]:
    """The vision projector `with_projector` checked, bound to the model; its embeddings cached on disk; and
    why one found beside the model was not loaded ("" where none was left out). One named by the profile must
    load; one found beside the model that does not fit leaves the chat without images (a line now, and again
    at /attach)."""
    try:
        if left_out:
            raise ModelError(left_out)
        if info.projector is None:
            return None, ""
        if engine.mrope and info.projector_kind not in QWEN_VL:  # libmtmd would place its images by M-RoPE
            raise ModelError(f"{info.projector.name} ({info.projector_kind}) would place images by M-RoPE in a way "
                             "localchat is not tested with: Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's projectors are")
        try:
            config = engine.config
            cap = image_token_cap(info.projector_kind, min(config.n_ubatch, config.n_batch), info.n_embd)
            return Projector(info.projector, engine, info.name, cap), ""
        except OSError as exc:  # unreadable while it is fingerprinted
            raise ModelError(f"{info.projector.name} cannot be read: {exc.strerror or exc}") from None
    except ModelError as exc:
        if profile.mmproj != "auto":
            raise
        problem = f"the projector beside it is not loaded: {exc}"
        report(f"localchat: {problem}")
        return None, problem


def open_draft(profile: Profile, plan: MemoryPlan, engine: Engine, report: Report) -> DraftModel:
    """The draft model beside the model: on the same devices, which on a GPU profile must hold it on top
    of the plan; refused when its vocabulary is not the model's."""
    info, need, room = draft_need(profile, plan, report)
    if plan.gpu and need > room:
        raise ProfileError(f"{profile.source}: the draft model {info.name} needs {need / (1 << 30):.2f} GiB of GPU "
                           f"memory beside the plan's {plan.total_gpu_bytes / (1 << 30):.2f} GiB, and "
                           f"{max(room, 0) / (1 << 30):.2f} GiB is left; lower n_ctx or drop draft_model")
    draft = Engine(replace(engine.config, model_path=str(info.path), type_k="f16", type_v="f16", sequences=1))
    try:
        check_vocab(engine, draft)
    except ModelError:
        draft.close()
        raise
    return DraftModel(draft)


def open_runtime(profile: Profile, report: Report, verbose: bool = False, explicit_ctx: bool = False,
                 sequences: int = 2) -> Runtime:
    """`explicit_ctx`: n_ctx came from the command line (then above the trained context is an error);
    `sequences`: as engine_config."""
    # the other processes' load is measured from here to after the model loaded
    threads = ThreadFit(thread_count(profile.n_threads), thread_count(profile.n_threads_batch))
    requested = profile
    info = resolve_model(profile, report)
    info.check_loadable()
    profile, warning = effective_profile(fit_trained_context(profile, info, explicit_ctx, report))
    info, left_out = with_projector(profile, info)
    plan = plan_for(profile, info, report)
    for endpoint in profile.rpc_servers if plan.gpu else ():
        register_rpc(endpoint)  # answered rpc.probe in cards_for: ggml aborts on a server that does not
    engine = Engine(engine_config(profile, info, plan.n_ctx, verbose, threads.cores, plan, sequences))
    try:
        engine.check_finite()
        engine.warm_up()
        fmt = chat_format(engine, has_template=info.has_chat_template)
    except ModelError:
        engine.close()
        raise
    if profile.think:
        said = fmt.set_thinking(profile.think)
        if not said.startswith("thinking:"):
            report(f"localchat: think: {profile.think}: {said}")
    draft = None
    try:
        draft = open_draft(profile, plan, engine, report) if profile.draft_model else None
        projector, problem = open_projector(profile, info, left_out, engine, report)
    except (ModelError, ProfileError):
        if draft is not None:
            draft.close()
        engine.close()
        raise
    chat = Chat(engine, fmt, chat_settings(profile), vision=projector, vision_problem=problem, draft=draft)
    if projector is not None:
        engine.media.refill_with(functools.partial(attaching.refill, chat))
    rt = Runtime(profile, info, plan, engine, chat, warning, threads, draft=draft,
                 embedding=embedding_for(profile, report), requested=requested, projector=chat.vision)
    rt.refit_threads(min_window=0.25)
    return rt
