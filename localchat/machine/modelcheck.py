"""A model file's hyper-parameters checked against its tensor table before llama.cpp reads them.

llama.cpp asserts on some values instead of returning an error (a block count of 0, more experts
than it supports, expert counts that do not agree, a per-layer head count its tensors do not have,
an unknown rope scaling, a sliding window with no sliding layer, a non-finite norm epsilon, a
duplicated or missing vocabulary): the assert aborts the whole process, or the first decode spins
(a rope dimension of 0). Each rule here is one such case (llama-model.cpp's load_hparams, the
vocabulary's load, context creation, the first decode), found by loading 252 damaged copies of real
files in child processes; a few more refuse early what llama.cpp would refuse with an error anyway
(missing keys, mismatched array lengths) so that the file is described safely first. The rest of
llama.cpp's refusals are its own, their reason read from its log at the load.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from localchat.machine.gguf_file import STRING, GGUFInfo

MAX_LAYERS = 512  # LLAMA_MAX_LAYERS
MAX_EXPERTS = 1024  # LLAMA_MAX_EXPERTS
ROPE_SCALINGS = ("none", "linear", "yarn", "longrope")
# architectures llama.cpp always runs with M-RoPE (its rope sections); glm4 and others only where sections are set
M_ROPE = ("qwen2vl", "paddleocr", "qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe", "qwen4exp", "qwen3tts")
# llama.cpp's default sliding-window pattern per architecture, when the GGUF does not store one (load_swa_pattern)
SWA_PATTERNS = {"gemma2": 2, "gemma3": 6, "gemma-embedding": 6, "gemma3n": 5, "cohere2": 4, "cohere2moe": 4,
                "gpt-oss": 2, "afmoe": 4, "exaone4": 4, "exaone-moe": 4, "laguna": 4, "llama4": 4, "mellum": 4,
                "modern-bert": 3, "muse-glimmer": 4, "olmo2": 4, "plamo3": 8, "smallthinker": 4}
DENSE_FIRST = ("cohere2moe", "laguna", "modern-bert", "smallthinker")  # a full layer opens each period, not ends it
SHARED_KV = ("gemma3n", "gemma4")  # their last layers read an earlier layer's KV; llama.cpp always slides them
GEMMA3N_KV_LAYERS = 20  # Gemma 3n's layers past these read their KV (fixed in llama.cpp's gemma3n.cpp)
DEEPSTACK = ("qwen3vl", "qwen3vlmoe")  # image rows wider than the text, a slice added after each of the first blocks
BYTE_TOKENS_SPM = 128  # an SPM vocabulary spells unknown characters in <0x80>..<0xFF> byte tokens at least
NUMBER_KEYS = ("block_count", "embedding_length", "context_length", "attention.head_count",
               "attention.head_count_kv", "attention.key_length", "attention.value_length",
               "attention.sliding_window", "feed_forward_length", "expert_count", "expert_used_count",
               "rope.dimension_count")
SPECIAL_TOKENS = ("bos", "eos", "eot", "eom", "unknown", "separator", "padding", "mask", "cls",
                  "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")
REMEDY = "the file is damaged or was made by an incompatible converter; re-download it or pick another file"


def problem(g: GGUFInfo) -> str:
    """Why llama.cpp would abort on this file ("" when nothing found): the first broken rule."""
    return next(_problems(g), "")


def sliding_layers(g: GGUFInfo, arch: str, n_layer: int) -> tuple[bool, ...]:
    """Per layer: whether it holds only the sliding window (llama.cpp's set_swa_pattern, or the stored list)."""
    window = g.get(f"{arch}.attention.sliding_window", 0)
    pattern = g.get(f"{arch}.attention.sliding_window_pattern", SWA_PATTERNS.get(arch, 0))
    if not (isinstance(window, int) and window > 0):
        return (False,) * n_layer
    if isinstance(pattern, list):
        return tuple(bool(x) for x in (pattern + [False] * n_layer)[:n_layer])
    p = pattern if isinstance(pattern, int) and not isinstance(pattern, bool) else 0
    if arch in DENSE_FIRST:
        return tuple(p == 0 or i % p != 0 for i in range(n_layer))
    return tuple(p == 0 or (i % p < p - 1) for i in range(n_layer))


def kv_from(g: GGUFInfo, arch: str, n_layer: int) -> int:
    """The first layer that keeps no KV of its own (llama.cpp's n_layer_kv_from_start; n_layer where all keep one):
    Gemma 3n's 21st, Gemma 4's first of its shared_kv_layers."""
    if arch == "gemma3n":
        return GEMMA3N_KV_LAYERS
    shared = g.get(f"{arch}.attention.shared_kv_layers", 0)
    return n_layer - shared if arch == "gemma4" and isinstance(shared, int) else n_layer


def ignored(g: GGUFInfo) -> list[str]:
    """Metadata of the wrong type that localchat does without (the value is ignored, a default serves)."""
    key = "tokenizer.chat_template"  # llama.cpp refuses other keys of the wrong type itself, with its reason
    if key in g.value_types and g.value_types[key] != STRING:
        return [f"{key} is not text; ignored: the chat uses the fallback format"]
    return []


def _problems(g: GGUFInfo) -> Iterator[str]:
    arch = g.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        yield "it has no general.architecture text: not a model file llama.cpp can run"
        return
    hp = _Hparams(g, arch)
    if not any(k.startswith(f"{arch}.") for k in g.metadata):
        return  # an architecture this reader has no keys for: llama.cpp names it unknown (its log says so)
    yield from hp.types()
    yield from hp.layers()
    yield from hp.experts()
    yield from hp.heads()
    yield from hp.sliding_window()
    yield from hp.shared_kv()
    yield from hp.rope_and_norms()
    yield from hp.m_rope()
    yield from _vocabulary(g, arch)


class _Hparams:
    def __init__(self, g: GGUFInfo, arch: str):
        self.g, self.arch = g, arch
        self.tensors = {t.name: t.shape for t in g.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        return self.g.get(f"{self.arch}.{key}", default)

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.g.metadata

    def types(self) -> Iterator[str]:
        for key in NUMBER_KEYS:
            value = self.get(key)
            if not self.has(key) or (f"{self.arch}.{key}" in self.g.array_lengths and value is None):
                continue
            items = value if isinstance(value, list) else [value]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
                yield f"{self.arch}.{key} is {_kind(value)}, not a whole number"

    def layers(self) -> Iterator[str]:
        for key in ("block_count", "embedding_length", "context_length"):  # llama.cpp reads them for every model
            if not self.has(key):
                yield f"it has no {self.arch}.{key}"
        n = self.get("block_count")
        if isinstance(n, int) and not 0 < n <= MAX_LAYERS:
            yield f"{self.arch}.block_count is {n}; llama.cpp takes 1 to {MAX_LAYERS} layers"
        nextn = self.get("nextn_predict_layers", 0)
        if isinstance(nextn, int) and isinstance(n, int) and nextn > n:
            yield f"{self.arch}.nextn_predict_layers ({nextn}) is more than its {n} layers"
        value = self.get("embedding_length")
        if isinstance(value, int) and value <= 0:
            yield f"{self.arch}.embedding_length is {value}"

    def experts(self) -> Iterator[str]:
        n, used = self._int("expert_count"), self._max("expert_used_count")
        groups, group_used = self._int("expert_group_count"), self._int("expert_group_used_count")
        name = f"{self.arch}.expert_count"
        if n > MAX_EXPERTS:
            yield f"{name} is {n}; llama.cpp takes at most {MAX_EXPERTS} experts"
        elif used > n:
            yield f"{self.arch}.expert_used_count ({used}) is more than its {n} experts"
        elif n and not used:
            yield f"it declares {n} experts and uses none of them ({self.arch}.expert_used_count)"
        elif n and not any("_exps" in t for t in self.tensors):
            yield f"it declares {n} experts but has no expert tensors"
        elif n and (groups >= n or (groups > 1 and (n % groups or not 0 < group_used < groups))):
            yield f"its expert groups ({groups}, {group_used} used) do not divide its {n} experts"
        elif not n and groups:
            yield f"it declares {groups} expert groups and no experts"

    def heads(self) -> Iterator[str]:
        """Per-layer head counts against each layer's attention tensors (a mismatch aborts the first decode)."""
        n_layer, n_embd = self._int("block_count"), self._int("embedding_length")
        heads, kv = self.get("attention.head_count"), self.get("attention.head_count_kv")
        heads_at = _layers(heads, n_layer)
        attention = any(f"blk.0.{n}.weight" in self.tensors for n in ("attn_q", "attn_qkv", "attn_k"))
        if attention and n_layer and heads_at[0] <= 0:
            yield f"{self.arch}.attention.head_count is {heads_at[0]} for a model with attention"
            return
        if not isinstance(kv, list):
            return
        kv_at = _layers(kv, n_layer)
        dim_k = self._head_size() if heads_at[0] > 0 else n_embd
        dim_v = self._int("attention.value_length") or dim_k
        dims = {False: (dim_k, dim_v), True: (self._int("attention.key_length_swa") or dim_k,
                                              self._int("attention.value_length_swa") or dim_v)}
        for i, slides in enumerate(sliding_layers(self.g, self.arch, n_layer)):
            k, v = dims[slides]  # Gemma 4's sliding layers have heads of their own size
            for tensor, want in ((f"blk.{i}.attn_k.weight", k * kv_at[i]), (f"blk.{i}.attn_v.weight", v * kv_at[i])):
                shape = self.tensors.get(tensor)
                if shape is not None and len(shape) > 1 and shape[1] != want:
                    yield f"layer {i}'s head count ({kv_at[i]} key/value heads) does not match {tensor} {shape}"
                    return

    def sliding_window(self) -> Iterator[str]:
        """A sliding window with no layer that slides aborts at context creation."""
        window, pattern = self._int("attention.sliding_window"), self.get("attention.sliding_window_pattern")
        n_layer = self._int("block_count")
        if not window or pattern is None:
            return
        if (isinstance(pattern, int) and pattern == 1) or (isinstance(pattern, list) and not any(pattern[:n_layer])):
            yield f"{self.arch}.attention.sliding_window is {window} but its pattern makes no layer slide"

    def shared_kv(self) -> Iterator[str]:
        """Gemma 3n's and 4's last layers read the KV of the last sliding and the last full layer before them:
        llama.cpp asserts at context creation that two layers keep their own and that those two are of each kind
        (its window always used: none leaves its sliding layers nothing to read)."""
        n_layer, window = self._int("block_count"), self._int("attention.sliding_window")
        if self.arch not in SHARED_KV or not 0 < n_layer <= MAX_LAYERS or not self.has("attention.sliding_window"):
            return
        if window <= 0:
            yield f"{self.arch}.attention.sliding_window is {window}; its sliding layers need a window"
            return
        keep = kv_from(self.g, self.arch, n_layer)
        if keep < 2:
            yield (f"{self.arch}.attention.shared_kv_layers ({n_layer - keep}) leaves fewer than 2 of its {n_layer} "
                   "layers a KV of their own")
            return
        slides, shared = sliding_layers(self.g, self.arch, n_layer), f"its layers {keep} to {n_layer - 1}"
        if any(slides[keep:]) and not slides[keep - 2]:
            yield f"{shared} would read their sliding window from layer {keep - 2}'s KV, which does not slide"
        elif not all(slides[keep:]) and slides[keep - 1]:
            yield f"{shared} would read their full attention from layer {keep - 1}'s KV, which slides"

    def rope_and_norms(self) -> Iterator[str]:
        scaling = self.get("rope.scaling.type")
        if self.has("rope.scaling.type") and scaling not in ROPE_SCALINGS:
            yield f"{self.arch}.rope.scaling.type is {scaling!r}; llama.cpp knows {', '.join(ROPE_SCALINGS)}"
        head_dim = self._head_size()
        for key, size in (("rope.dimension_count", head_dim),
                          ("rope.dimension_count_swa", self._int("attention.key_length_swa") or head_dim)):
            n_rot = self.get(key)
            if isinstance(n_rot, int) and size and (n_rot <= 0 or n_rot % 2 or n_rot > size):
                yield f"{self.arch}.{key} is {n_rot}; it must be even, above 0 and at most the head size ({size})"
        for key in ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon"):
            eps = self.get(key)
            if self.has(key) and not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
                yield f"{self.arch}.{key} is {eps!r}; it must be a small positive number"

    def m_rope(self) -> Iterator[str]:
        """M-RoPE's sections split a head (more than it holds abort the first decode, as do none for an
        architecture that always uses them); a deepstack slice after the last block aborts any longer prompt."""
        sections = self.get("rope.dimension_sections")
        if isinstance(sections, list) and all(isinstance(v, int) for v in sections):
            size = self._head_size()
            if size and sum(sections[:4]) > size:
                yield f"{self.arch}.rope.dimension_sections {sections[:4]} add up to more than its head size ({size})"
            elif self.arch in M_ROPE and not any(v > 0 for v in sections[:3]):
                yield f"{self.arch}.rope.dimension_sections {sections[:4]} give its image positions no dimension"
        deepstack, n_layer = self._int("n_deepstack_layers"), self._int("block_count")
        if self.arch in DEEPSTACK and n_layer and deepstack >= n_layer:
            yield f"{self.arch}.n_deepstack_layers ({deepstack}) is not below its {n_layer} layers"

    def _head_size(self) -> int:
        """A key head's size as llama.cpp takes it: key_length, or the embedding over layer 0's head count
        (0 when there are no heads to divide by)."""
        heads = _layers(self.get("attention.head_count"), 1)[0]
        return self._int("attention.key_length") or (self._int("embedding_length") // heads if heads > 0 else 0)

    def _int(self, key: str) -> int:
        value = self.get(key, 0)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    def _max(self, key: str) -> int:
        value = self.get(key, 0)
        items = value if isinstance(value, list) else [value]
        return max((v for v in items if isinstance(v, int) and not isinstance(v, bool)), default=0)


def _vocabulary(g: GGUFInfo, arch: str) -> Iterator[str]:
    model = g.get("tokenizer.ggml.model")
    n_tokens = g.array_lengths.get("tokenizer.ggml.tokens")
    if model == "none" or (model is not None and n_tokens is None):
        yield "it has no vocabulary (tokenizer.ggml.model none, or no token list): it cannot be chatted with"
        return
    if n_tokens is None:
        return
    if g.duplicate_tokens:
        yield f"its token list has {g.duplicate_tokens} duplicated tokens"
    if model == "llama" and g.high_byte_tokens < BYTE_TOKENS_SPM:  # a character outside it would abort
        yield (f"its SentencePiece vocabulary (tokenizer.ggml.model llama) has {g.high_byte_tokens} of the byte "
               "tokens <0x80>..<0xFF>")
    if model == "bert" and g.byte_tokens:
        yield f"its WordPiece vocabulary (tokenizer.ggml.model bert) has {g.byte_tokens} byte tokens"
    if model == "rwkv" and not arch.startswith("rwkv"):
        yield f"an RWKV vocabulary on a {arch} model"
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if key in g.array_lengths and g.array_lengths[key] != n_tokens:
            yield f"{key} has {g.array_lengths[key]} entries for {n_tokens} tokens"
    for tensor in ("token_embd.weight", "output.weight"):
        shape = next((t.shape for t in g.tensors if t.name == tensor), None)
        if shape is not None and len(shape) > 1 and shape[1] != n_tokens:
            yield f"{tensor} has {shape[1]} rows for {n_tokens} tokens"
    for name in SPECIAL_TOKENS:
        token = g.get(f"tokenizer.ggml.{name}_token_id")
        if isinstance(token, int) and not isinstance(token, bool) and not -1 <= token < n_tokens \
                and token != 0xFFFFFFFF:  # -1 stored unsigned: none
            yield f"tokenizer.ggml.{name}_token_id is {token}, outside its {n_tokens} tokens"


def _layers(value: Any, n_layer: int) -> list[int]:
    items = value if isinstance(value, list) else [value] * n_layer
    items = [v if isinstance(v, int) and not isinstance(v, bool) else 0 for v in items]
    return (items + [0] * n_layer)[:n_layer]


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return "a list holding " + ", ".join(sorted({type(v).__name__ for v in value}))
    return {str: "text", float: "a fraction", bool: "true/false"}.get(type(value), type(value).__name__)
