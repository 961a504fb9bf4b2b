"""Model resolution (path, built-in alias, discovery) and what a GGUF tells about its KV cache."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from localchat import paths
from localchat.errors import ModelError
from localchat.machine import modelcheck
from localchat.machine.fetch import ASSISTANT, BUILTIN_MODELS, Report, cached_path, ensure_builtin
from localchat.machine.gguf_file import GGML_TYPE_NAMES, GGUFInfo, read_gguf

# bytes per stored value for each KV cache type
KV_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32,
                 "q4_1": 20 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32, "iq4_nl": 18 / 32}

# llama_ftype -> name, for general.file_type
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
    29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4_MOE",
}

CANNOT_LOAD = "llama.cpp cannot load it"

# architectures that only encode: sentence embeddings, never a reply
ENCODERS = {"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3", "modern-bert", "neo-bert",
            "eurobert", "t5encoder", "gemma-embedding"}


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    name: str
    arch: str
    n_params: int
    quant: str
    file_size: int
    n_ctx_train: int
    n_layer: int
    n_embd: int
    n_head_kv: tuple[int, ...]  # per layer
    head_dim_k: int
    head_dim_v: int
    n_swa: int  # sliding window size, 0 when none
    swa_layers: tuple[bool, ...]  # per layer: holds only the window
    head_dims_swa: tuple[int, int]  # the sliding layers' K and V head sizes (Gemma 4's differ from the full ones')
    kv_from: int  # layers from here on read an earlier layer's KV and keep none (Gemma 3n/4); n_layer: none do
    has_chat_template: bool
    tensor_bytes: int
    layer_bytes: tuple[int, ...]  # weight bytes per repeating layer (blk.N.*)
    output_bytes: int  # the output projection (or the tied embedding used as one)
    n_vocab: int
    n_head: int
    n_ff: int
    notices: tuple[str, ...] = ()  # metadata of the wrong type, ignored (modelcheck.ignored)
    problem: str = ""  # why llama.cpp would abort on the file ("" when nothing was found): it is not loaded
    pooling: int = 0  # {arch}.pooling_type: an embedding model pools its tokens into one vector
    projector: Path | None = None  # the vision projector loaded beside it, checked (runtime.with_projector)
    projector_bytes: int = 0  # its weights and encoder (planned on the first device)
    projector_kind: str = ""  # its clip.projector_type (gemma3, qwen2vl_merger, ...)

    @property
    def embeds_only(self) -> bool:
        """An embedding model: it makes sentence vectors (embedding_model), not replies."""
        return self.arch in ENCODERS or self.pooling > 0

    def check_loadable(self) -> None:
        """Stop before llama.cpp reads a file it would abort on."""
        if self.problem:
            raise ModelError(f"{self.path.name}: {self.problem}")

    def kv_widths(self) -> list[tuple[int, int]]:
        """K and V values one token keeps in each layer, as llama.cpp sizes them (hparams.n_embd_k_gqa)."""
        dims = {False: (self.head_dim_k, self.head_dim_v), True: self.head_dims_swa}
        return [(h * dims[s][0], h * dims[s][1]) for h, s in zip(self.n_head_kv, self.swa_layers)]

    def kv_layer_bytes(self, type_k: str = "f16", type_v: str = "f16", flash_attn: bool = True) -> list[float]:
        """Bytes one KV cell (one token) takes in each layer: none in a layer that reads another's; without flash
        attention V is stored transposed and every layer's V row is as wide as the widest (llama-kv-cache.cpp)."""
        bk, bv = KV_TYPE_BYTES[type_k], KV_TYPE_BYTES[type_v]
        widths = self.kv_widths()
        v_max = max((v for _, v in widths), default=0)
        return [(k * bk + (v if flash_attn else v_max) * bv) if i < self.kv_from else 0.0
                for i, (k, v) in enumerate(widths)]

    def kv_bytes_per_token(self, type_k: str = "f16", type_v: str = "f16", swa: bool | None = None,
                           flash_attn: bool = True) -> int:
        """KV bytes per token over all layers, or over the sliding (swa=True) / global (False) ones."""
        layers = self.kv_layer_bytes(type_k, type_v, flash_attn)
        return round(sum(b for b, s in zip(layers, self.swa_layers) if swa is None or s == swa))

    def swa_cells(self, n_ctx: int, n_ubatch: int, swa_full: bool) -> int:
        """Cells llama.cpp gives the sliding-window layers (llama-kv-cache-iswa.cpp)."""
        if not self.n_swa or swa_full:
            return n_ctx
        return min(n_ctx, -(-(min(n_ctx, self.n_swa + n_ubatch)) // 256) * 256)

    def kv_bytes(self, n_ctx: int, type_k: str, type_v: str, n_ubatch: int = 512, swa_full: bool = False,
                 flash_attn: bool = True) -> int:
        full = self.kv_bytes_per_token(type_k, type_v, swa=False, flash_attn=flash_attn)
        window = self.kv_bytes_per_token(type_k, type_v, swa=True, flash_attn=flash_attn)
        return full * n_ctx + window * self.swa_cells(n_ctx, n_ubatch, swa_full)


def _per_layer(value, n_layer: int) -> tuple[int, ...]:
    if isinstance(value, list):
        return tuple(int(v) for v in value[:n_layer])
    return (int(value),) * n_layer


def model_info(path: str | Path, gguf: GGUFInfo | None = None) -> ModelInfo:
    """Everything the plan and the listing need, read from the GGUF header alone."""
    g = gguf or read_gguf(path)
    arch = g.get("general.architecture")
    if not arch:
        raise ModelError(f"{Path(g.path).name}: it has no general.architecture: not a model file llama.cpp can run")
    problem = modelcheck.problem(g)
    try:
        return _describe(g, arch, f"{CANNOT_LOAD}: {problem}; {modelcheck.REMEDY}" if problem else "")
    except (TypeError, ValueError, ZeroDivisionError, IndexError):  # metadata too damaged to describe
        raise ModelError(f"{Path(g.path).name}: {CANNOT_LOAD}: {problem or 'its metadata is not understood'}; "
                         f"{modelcheck.REMEDY}") from None


def _describe(g: GGUFInfo, arch: str, problem: str) -> ModelInfo:
    a = lambda key, default=None: g.get(f"{arch}.{key}", default)  # noqa: E731
    n_layer = min(int(a("block_count", 0)), modelcheck.MAX_LAYERS + 1)  # a damaged count is described bounded
    n_embd = int(a("embedding_length", 0))
    n_head = a("attention.head_count", 1)
    n_head0 = n_head[0] if isinstance(n_head, list) else int(n_head)
    n_head_kv = _per_layer(a("attention.head_count_kv", n_head), n_layer)
    head_dim_k = int(a("attention.key_length", n_embd // max(n_head0, 1)))
    head_dim_v = int(a("attention.value_length", head_dim_k))
    n_swa = int(a("attention.sliding_window", 0) or 0)
    swa_layers = modelcheck.sliding_layers(g, arch, n_layer)
    head_dim_k_swa = int(a("attention.key_length_swa", head_dim_k))
    head_dims_swa = (head_dim_k_swa, int(a("attention.value_length_swa", head_dim_v)))
    layer_bytes = [0] * n_layer
    total = 0
    for t in g.tensors:
        size = t.n_bytes or 0
        total += size
        if t.name.startswith("blk."):
            idx = t.name.split(".")[1]
            if idx.isdigit() and int(idx) < n_layer:
                layer_bytes[int(idx)] += size
    sizes = {t.name: t.n_bytes or 0 for t in g.tensors}
    output = sizes.get("output.weight", sizes.get("token_embd.weight", 0))
    ftype = g.get("general.file_type")
    if ftype in FILE_TYPES:
        quant = FILE_TYPES[ftype]
    else:
        counts: dict[int, int] = {}
        for t in g.tensors:
            counts[t.ggml_type] = counts.get(t.ggml_type, 0) + t.n_elements
        quant = GGML_TYPE_NAMES.get(max(counts, key=counts.__getitem__), "?") if counts else "?"
    return ModelInfo(
        path=Path(g.path), name=_text(g.get("general.name")) or Path(g.path).stem, arch=arch,
        n_params=sum(t.n_elements for t in g.tensors), quant=quant, file_size=g.file_size,
        n_ctx_train=int(a("context_length", 0) or 0), n_layer=n_layer, n_embd=n_embd,
        n_head_kv=n_head_kv, head_dim_k=head_dim_k, head_dim_v=head_dim_v, n_swa=n_swa,
        swa_layers=swa_layers, head_dims_swa=head_dims_swa, kv_from=modelcheck.kv_from(g, arch, n_layer),
        has_chat_template=bool(_text(g.get("tokenizer.chat_template"))),
        tensor_bytes=total, layer_bytes=tuple(layer_bytes), output_bytes=output,
        n_vocab=g.array_lengths.get("tokenizer.ggml.tokens", 0), n_head=n_head0,
        n_ff=int((lambda v: max(v) if isinstance(v, list) else v)(a("feed_forward_length", 0)) or 0),
        notices=tuple(modelcheck.ignored(g)),
        problem=problem, pooling=int(a("pooling_type", 0) or 0),
    )


def _text(value: object) -> str:
    """A metadata value that must be text, or "" when it is something else (checked and told apart)."""
    return value if isinstance(value, str) else ""


# ---------------------------------------------------------------- discovery


@dataclass(frozen=True)
class FoundModel:
    name: str
    path: Path
    source: str


def _hf_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    hf_home = os.environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")
    return Path(hf_home) / "hub"


def _ollama_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


def _ollama_models(root: Path) -> list[FoundModel]:
    """Ollama keeps GGUFs as content-addressed blobs; the manifests give them names."""
    found = []
    manifests = root / "manifests"
    for manifest in sorted(manifests.rglob("*")) if manifests.is_dir() else []:
        if not manifest.is_file():
            continue
        try:
            layers = json.loads(manifest.read_text()).get("layers", [])
        except (OSError, ValueError, AttributeError):
            continue
        for layer in layers:
            if isinstance(layer, dict) and layer.get("mediaType") == "application/vnd.ollama.image.model":
                blob = root / "blobs" / str(layer.get("digest", "")).replace(":", "-")
                if blob.is_file():
                    parts = manifest.relative_to(manifests).parts
                    found.append(FoundModel(f"{parts[-2]}:{parts[-1]}" if len(parts) >= 2 else parts[-1],
                                            blob, "ollama"))
    return found


def discover() -> list[FoundModel]:
    """GGUFs in the models cache, the Hugging Face hub cache, LM Studio and Ollama."""
    found: list[FoundModel] = []
    roots = [(paths.models_dir(), "cache"), (_hf_cache(), "huggingface"),
             (Path.home() / ".lmstudio" / "models", "lmstudio"),
             (Path.home() / ".cache" / "lm-studio" / "models", "lmstudio")]
    for root, source in roots:
        if root.is_dir():
            for p in sorted(root.rglob("*.gguf")):
                if p.is_file() and not p.name.startswith("."):
                    found.append(FoundModel(p.stem, p, source))
    found.extend(_ollama_models(_ollama_dir()))
    return found


def resolve(spec: str | None, report: Report) -> Path:
    """A model path from a file path, a built-in alias or the name of a discovered model."""
    spec = spec or ASSISTANT
    if spec in BUILTIN_MODELS:
        return ensure_builtin(spec, report)
    p = Path(spec).expanduser()
    if p.is_file():
        return p
    if p.suffix == ".gguf" or os.sep in spec:
        raise ModelError(f"model file not found: {spec}")
    matches = [m for m in discover() if m.name == spec or m.name.lower().startswith(spec.lower())]
    if not matches:
        raise ModelError(f"no model named '{spec}': give a .gguf path, a built-in ({', '.join(BUILTIN_MODELS)}), "
                         "or a name from 'localchat models'")
    return matches[0].path


def builtin_cached(alias: str) -> Path | None:
    p = cached_path(BUILTIN_MODELS[alias])
    return p if p.exists() else None
