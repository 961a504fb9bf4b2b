"""Composition: profile + model + memory plan -> engine -> chat session (and its store)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable

from localchat import models, plan as planmod, profiles
from localchat.chat import ChatSession, ChatSettings
from localchat.engine import Engine, EngineConfig, SamplingConfig, gpu_offload_supported
from localchat.models import ModelInfo
from localchat.plan import MemoryPlan
from localchat.profiles import Profile
from localchat.templates import ChatFormat

log = logging.getLogger(__name__)

CUDA_INSTALL = ('CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir '
                '"llama-cpp-python>=0.3.36,<0.4"')

Report = Callable[[str], None]


@dataclass
class Runtime:
    profile: Profile
    model: ModelInfo
    plan: MemoryPlan
    engine: Engine
    chat: ChatSession
    gpu_warning: str = ""

    def close(self) -> None:
        self.engine.close()


def load_profile(name: str | None, overrides: dict[str, Any]) -> Profile:
    return profiles.with_overrides(profiles.load(name or "cpu"), **overrides)


def resolve_model(profile: Profile, report: Report) -> ModelInfo:
    return models.model_info(models.resolve(profile.model, report))


def effective_profile(profile: Profile) -> tuple[Profile, str]:
    """Without a GPU build, offloading does nothing: plan for the CPU and say so once."""
    if profile.offloads and not gpu_offload_supported():
        warning = (f"profile '{profile.name}' offloads layers but this llama-cpp-python has no GPU support; "
                   f"running on the CPU. Install the CUDA build: {CUDA_INSTALL}")
        return replace(profile, n_gpu_layers=0, vram_gb=0.0, reserve_gb=0.0), warning
    return profile, ""


def make_plan(profile: Profile, info: ModelInfo) -> MemoryPlan:
    plan = planmod.make_plan(profile, info)
    planmod.check_fits(plan, profile)
    return plan


def engine_config(profile: Profile, info: ModelInfo, n_ctx: int, verbose: bool) -> EngineConfig:
    return EngineConfig(
        model_path=str(info.path), n_ctx=n_ctx, n_gpu_layers=profile.n_gpu_layers,
        n_threads=profile.n_threads, flash_attn=profile.flash_attn, type_k=profile.type_k,
        type_v=profile.type_v, n_batch=profile.n_batch, n_ubatch=profile.n_ubatch,
        swa_full=profile.swa_full, verbose=verbose)


def chat_settings(profile: Profile) -> ChatSettings:
    seed = profile.seed if profile.seed >= 0 else 0xFFFFFFFF
    sampling = SamplingConfig(temperature=profile.temperature, top_k=profile.top_k, top_p=profile.top_p,
                              min_p=profile.min_p, repeat_penalty=profile.repeat_penalty, seed=seed)
    return ChatSettings(system=profile.system, max_tokens=profile.max_tokens, sampling=sampling,
                        overflow=profile.overflow)


def chat_format(engine: Engine) -> ChatFormat:
    return ChatFormat(engine.meta("tokenizer.chat_template"), engine.special_text("bos"),
                      engine.special_text("eos"))


def open_runtime(profile: Profile, report: Report, verbose: bool = False) -> Runtime:
    info = resolve_model(profile, report)
    profile, warning = effective_profile(profile)
    plan = make_plan(profile, info)
    engine = Engine(engine_config(profile, info, plan.n_ctx, verbose))
    chat = ChatSession(engine, chat_format(engine), chat_settings(profile))
    return Runtime(profile, info, plan, engine, chat, warning)
