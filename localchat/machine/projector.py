"""A vision projector file (an mmproj GGUF) read before llama.cpp sees it: found beside its model the way
other tools name it, checked where clip.cpp would abort instead of failing (integers it reads as
uint32, floats as f32), and sized for the memory plan: its weights and its encoder's compute buffer."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from localchat.errors import ModelError
from localchat.machine.gguf_file import GGUFInfo, read_gguf

U32, I32, F32, BOOL, STRING, ARRAY = 4, 5, 6, 7, 8, 9
WANTED_TYPES = {U32: "uint32", I32: "int32", F32: "float32", BOOL: "bool", STRING: "string", ARRAY: "array"}
MAX_BLOCKS = 1024
FIXED_SIZE = ("gemma3", "idefics3")  # projector types whose images are resized to image_size, in patches
QWEN_VL = ("qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger")  # any image size, 2x2 merged, M-RoPE
UNTESTED_M_ROPE = ("qwen2.5o",)  # refused by name: its graph's rules differ from Qwen2-VL's
QWEN_MAX_TOKENS = 4096  # clip.cpp's limit of a Qwen-VL image's tokens (each of 2x2 patches)
QWEN_MAX_PATCH = 56  # Qwen2.5-VL's window of 112 pixels holds no merged patch past this: clip.cpp loops forever
# Gemma 4: images sized to 70-1,120 tokens of 3x3 pooled patches (the unified variant pools in its patch), placed
# by a pair of x/y position tables; its converter writes the type as clip.vision.projector_type
GEMMA4 = ("gemma4v", "gemma4uv")  # the unified variant pools its patches in its convolution, the other after
GEMMA4_POOL = 3  # patches a side pooled into a token, where the file names none
GEMMA4_TOKENS = (70, 1120)  # clip.cpp's least and most tokens a Gemma 4 image takes
GEMMA4_CAUSAL_WIDTHS = (1536, 2560)  # E2B's and E4B's text widths: their image tokens are causal (mtmd.cpp)
SHARED_START = 6  # characters two names share at their start to be taken as one model's files
ENCODER_FIXED = 8 << 20  # clip.cpp's graph and input staging beside the activations
REQUIRED = ("clip.vision.image_size", "clip.vision.patch_size", "clip.vision.embedding_length",
            "clip.vision.block_count", "clip.vision.attention.head_count")


@dataclass(frozen=True)
class ProjectorInfo:
    path: Path
    kind: str  # clip.projector_type (or clip.vision.projector_type): gemma3, idefics3, gemma4v, ...
    weight_bytes: int
    compute_bytes: int  # the encoder's compute buffer for one image, estimated from its shape

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.compute_bytes


def find_beside(model: Path) -> Path | None:
    """The projector beside the model: a .gguf with mmproj in its name, in a folder that is the model's own
    (every other model in it starts as the model's name does, as a repository's quantizations do), or one whose
    name starts as the model's; of several, f16 before bf16 before f32, then the one most like the model's name."""
    name = model.name.lower()
    ggufs = [p for p in model.parent.glob("*.gguf") if p != model]
    projectors = [p for p in ggufs if "mmproj" in p.name.lower()]
    own = all(_common_start(p.name.lower(), name) >= SHARED_START for p in ggufs if p not in projectors)
    found = [p for p in projectors if own or _common_start(_unprefixed(p.name), name) >= SHARED_START]
    return min(found, key=lambda p: (_precision(p.name.lower()), -_common_start(_unprefixed(p.name), name),
                                     p.name), default=None)


def _unprefixed(name: str) -> str:
    """A projector's name without its leading "mmproj-" (mmproj-gemma-3-4b-f16.gguf: gemma-3-4b-f16.gguf)."""
    low = name.lower()
    return low[7:] if low.startswith(("mmproj-", "mmproj_", "mmproj.")) else low


def _common_start(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def _precision(name: str) -> int:
    return 0 if "f16" in name.replace("bf16", "") else 1 if "bf16" in name else 2 if "f32" in name else 3


def projector_info(path: Path) -> ProjectorInfo:
    """The projector read and checked; ModelError (one line) where llama.cpp would abort or refuse it."""
    g = read_gguf(path)
    name = path.name
    if g.get("general.architecture") != "clip":
        raise ModelError(f"{name} is not a vision projector (its architecture is {g.get('general.architecture')!r}, "
                         "not 'clip'): give the mmproj GGUF made with the model")
    if g.get("clip.has_vision_encoder") is not True:
        raise ModelError(f"{name} has no vision encoder (an audio projector?); images need a vision one")
    for key in REQUIRED:
        if key not in g.metadata:
            raise ModelError(f"{name} lacks {key}: it is damaged or was written by an unknown converter")
    if not _kind(g):
        raise ModelError(f"{name} lacks clip.projector_type: it is damaged or was written by an unknown converter")
    if _kind(g) in UNTESTED_M_ROPE:
        raise ModelError(f"{name} is a {_kind(g)} projector (Qwen2.5-Omni), whose M-RoPE "
                         "placement localchat is not yet tested with; Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's are")
    for key, vtype in g.value_types.items():
        wanted = _wanted(key)
        if wanted is not None and vtype != wanted:
            raise ModelError(f"{name}: {key} is stored as GGUF type {vtype}, and llama.cpp aborts on anything but "
                             f"{WANTED_TYPES[wanted]}: the file is damaged or was written by an unknown converter")
        if key.endswith(("image_mean", "image_std")) and g.array_types.get(key) != F32:
            raise ModelError(f"{name}: {key} is not an array of float32, and llama.cpp aborts on it: the file is "
                             "damaged or was written by an unknown converter")
    problem = _shape_problem(g)
    if problem:
        raise ModelError(f"{name}: {problem}, which llama.cpp would abort on: the file is damaged")
    weights = sum(t.n_bytes or 0 for t in g.tensors)
    return ProjectorInfo(path, _kind(g), weights, _compute(g))


def _kind(g: GGUFInfo) -> str:
    """The projector's type: clip.projector_type, or where a converter of several modalities wrote it (Gemma 4's)
    clip.vision.projector_type, which clip.cpp reads when the first is absent."""
    return str(g.get("clip.projector_type") or g.get("clip.vision.projector_type") or "")


def image_token_cap(kind: str, batch: int, n_embd_text: int) -> tuple[int, int]:
    """The least and most tokens an image may take where the projector sizes images to a budget of its own and
    their positions see each other (evaluated in one batch): within the batch, so that every image fits one;
    (0, 0) keeps the projector's own budget. Whether they see each other is libmtmd's rule, known here before the
    projector is opened (vision.Projector checks it once it is)."""
    if kind == "gemma4v" and n_embd_text in GEMMA4_CAUSAL_WIDTHS:
        return 0, 0
    least, most = GEMMA4_TOKENS if kind in GEMMA4 else (0, 0)
    return (min(least, batch), batch) if 0 < batch < most else (0, 0)


def _shape_problem(g: GGUFInfo) -> str:
    """What of the vision encoder's sizes and tensors does not hold together ("" when all does): the parts
    every ViT projector shares, and the projection of the types localchat is tested with."""
    embd, heads = int(g.get("clip.vision.embedding_length")), int(g.get("clip.vision.attention.head_count"))
    size, patch = int(g.get("clip.vision.image_size")), int(g.get("clip.vision.patch_size"))
    if heads <= 0 or embd % heads:
        return f"clip.vision.attention.head_count {heads} does not divide its width {embd}"
    kind = _kind(g)
    if kind in FIXED_SIZE and (size <= 0 or patch <= 0 or size % patch):
        return f"clip.vision.image_size {size} is not a multiple of its patch size {patch}"
    blocks = int(g.get("clip.vision.block_count"))
    if not 0 <= blocks <= MAX_BLOCKS:
        return f"clip.vision.block_count {blocks} is past any encoder's (at most {MAX_BLOCKS})"
    shapes = {t.name: t.shape for t in g.tensors}
    side = size // patch if patch > 0 else 0
    wanted: dict[str, tuple[int, ...]] = {"v.patch_embd.weight": (patch, patch, 3, embd)}
    if kind not in QWEN_VL and kind not in GEMMA4:  # Qwen-VL's graph reads none (old files hold a dummy)
        # a row a patch, and one more for a class embedding (LLaVA's); Gemma 4's tables are checked apart
        wanted["v.position_embd.weight"] = (embd, side * side + ("v.class_embd" in shapes))
    for i in range(blocks):
        wanted.update({f"v.blk.{i}.attn_{w}.weight": (embd, embd) for w in ("q", "k", "v", "out")})
        wanted.update({f"v.blk.{i}.{n}.weight": (embd,) for n in ("ln1", "ln2")})
    merge = int(g.get("clip.vision.projector.scale_factor", 1) or 1)
    if kind == "gemma3" and "mm.input_projection.weight" in shapes:
        wanted["mm.input_projection.weight"] = (shapes["mm.input_projection.weight"][0], embd)
    if kind == "idefics3" and "mm.model.fc.weight" in shapes:
        wanted["mm.model.fc.weight"] = (embd * merge * merge, shapes["mm.model.fc.weight"][-1])
    for tensor, shape in wanted.items():
        if tensor in shapes and tuple(shapes[tensor]) != shape:
            return f"tensor {tensor} has the shape {list(shapes[tensor])}, its sizes say {list(shape)}"
    if kind in GEMMA4:
        return _gemma4_problem(g, shapes, embd, heads)
    return _qwen_problem(g, shapes) if kind in QWEN_VL else ""


def _gemma4_merge(g: GGUFInfo) -> int:
    """Gemma 4's encoder patches a token's side holds: its pooling, or 1 where the patch itself is pooled."""
    return 1 if _kind(g) == "gemma4uv" else max(int(g.get("clip.vision.projector.scale_factor", GEMMA4_POOL) or 1), 1)


def _gemma4_problem(g: GGUFInfo, shapes: dict, embd: int, heads: int) -> str:
    """Gemma 4's encoder reads its position tables without a check (a missing one is a null pointer, a short one
    overruns at an image's widest row of patches) and multiplies its projection by the encoder's width."""
    if int(g.get("clip.vision.projector.scale_factor", GEMMA4_POOL) or 0) <= 0:
        return "clip.vision.projector.scale_factor is 0 (the patches pooled into a token)"
    pos, least = tuple(shapes.get("v.position_embd.weight", ())), GEMMA4_TOKENS[1] * _gemma4_merge(g)
    if len(pos) != 3 or pos[0] != embd or pos[2] != 2 or pos[1] < least:
        found = list(pos) if pos else "missing"
        return f"tensor v.position_embd.weight is {found}, not two tables (x, y) {embd} wide of {least} positions"
    projection = tuple(shapes.get("mm.input_projection.weight", ()))
    if len(projection) != 2 or projection[0] != embd:
        found = list(projection) if projection else "missing"
        return f"tensor mm.input_projection.weight is {found}, not {embd} wide at its input"
    for i in range(int(g.get("clip.vision.block_count"))):
        for norm in (f"v.blk.{i}.attn_q_norm.weight", f"v.blk.{i}.attn_k_norm.weight"):
            if norm in shapes and tuple(shapes[norm]) not in ((embd // heads,), (embd,)):
                return f"tensor {norm} is {list(shapes[norm])}, neither a head ({embd // heads}) nor {embd} wide"
    return ""


def _qwen_problem(g: GGUFInfo, shapes: dict) -> str:
    """Qwen-VL's encoder: clip.cpp loads it without these tensors, or with them misshapen, and then crashes at
    the first image (SIGSEGV on a weight or bias it adds, SIGABRT on shapes that do not multiply), asserts on
    the sizes its rotary embedding and 2x2 merge take, or loops forever on a patch its windows cannot hold."""
    embd, heads = int(g.get("clip.vision.embedding_length")), int(g.get("clip.vision.attention.head_count"))
    windowed = _kind(g) == "qwen2.5vl_merger"
    problem = _qwen_sizes(g, embd, heads, windowed)
    if problem:
        return problem
    qwen3 = _kind(g) == "qwen3vl_merger"
    if not qwen3 and "v.patch_embd.bias" in shapes:
        return "it has a patch bias, which its encoder does not take"
    if len(shapes.get("mm.2.bias", ())) != 1:
        return "its output width (tensor mm.2.bias) is missing"
    out = shapes["mm.2.bias"][0]
    if windowed and int(g.get("clip.vision.projection_dim", 0) or 0) != out:
        return f"clip.vision.projection_dim is not its output width {out} (mm.2)"
    problem = _qwen3_extra(g, shapes, embd) if qwen3 else ""
    if problem:
        return problem
    required, optional = (_qwen3_tensors if qwen3 else _qwen_tensors)(g, shapes, embd, out)
    for tensor, shape in required.items():
        if tuple(shapes.get(tensor, ())) != shape:
            found = list(shapes[tensor]) if tensor in shapes else "missing"
            return f"tensor {tensor} is {found}, its sizes say {list(shape)}"
    for tensor, shape in optional.items():
        if tensor in shapes and tuple(shapes[tensor]) != shape:
            return f"tensor {tensor} is {list(shapes[tensor])}, its sizes say {list(shape)}"
    return ""


def _qwen_sizes(g: GGUFInfo, embd: int, heads: int, windowed: bool) -> str:
    patch = int(g.get("clip.vision.patch_size"))
    windows = int(g.get("clip.vision.n_wa_pattern", 0) or 0)
    if (embd // heads) % 4:
        return f"its heads are {embd // heads} wide, not a multiple of 4 (its rotary embedding's four parts)"
    if not 0 < patch <= QWEN_MAX_PATCH:
        return f"clip.vision.patch_size {patch} is past any Qwen-VL encoder's ({QWEN_MAX_PATCH} at most)"
    if int(g.get("clip.vision.spatial_merge_size", 2) or 0) != 2:
        return "clip.vision.spatial_merge_size is not 2 (its encoder merges 2x2 patches, whatever the file says)"
    if windowed and windows <= 0:
        return "it has no clip.vision.n_wa_pattern (which of its blocks attend to the whole image)"
    if not windowed and windows > 0:
        return "it has a window pattern, which only Qwen2.5-VL's encoder reads"
    return ""


def _qwen_tensors(g: GGUFInfo, shapes: dict, embd: int, out: int) -> tuple[dict, dict]:
    """The tensors it must have and those it may have, by shape. Files of the first converter (the surgery
    script) name the feed-forward's up and down the other way round: clip.cpp swaps them back, so does this."""
    up, down = "ffn_up", "ffn_down"
    if tuple(shapes.get("v.blk.0.ffn_down.weight", (0,)))[:1] == (embd,):
        up, down = down, up
    ffn = tuple(shapes.get(f"v.blk.0.{up}.weight", (embd, 0)))[-1]
    patch = int(g.get("clip.vision.patch_size"))
    required: dict[str, tuple[int, ...]] = {
        "v.patch_embd.weight": (patch, patch, 3, embd), "v.patch_embd.weight.1": (patch, patch, 3, embd),
        "mm.0.weight": (4 * embd, 4 * embd), "mm.0.bias": (4 * embd,), "mm.2.weight": (4 * embd, out)}
    optional: dict[str, tuple[int, ...]] = {"v.post_ln.weight": (embd,), "v.post_ln.bias": (embd,)}
    for i in range(int(g.get("clip.vision.block_count"))):
        b = f"v.blk.{i}."
        required.update({b + f"attn_{w}.{kind}": (embd, embd) if kind == "weight" else (embd,)
                         for w in ("q", "k", "v") for kind in ("weight", "bias")})
        required.update({b + "attn_out.weight": (embd, embd), b + f"{up}.weight": (embd, ffn),
                         b + f"{down}.weight": (ffn, embd)})
        optional.update(_block_optional(b, embd, ffn, up, down))
    return required, optional


def _block_optional(b: str, embd: int, ffn: int, up: str = "ffn_up", down: str = "ffn_down"
                    ) -> dict[str, tuple[int, ...]]:
    """A Qwen-VL encoder block's norms and biases, which clip.cpp adds only where the file has them."""
    optional: dict[str, tuple[int, ...]] = {b + f"{n}.{kind}": (embd,) for n in ("ln1", "ln2")
                                            for kind in ("weight", "bias")}
    optional.update({b + "attn_out.bias": (embd,), b + f"{up}.bias": (ffn,), b + f"{down}.bias": (embd,),
                     b + "ffn_gate.weight": (embd, ffn), b + "ffn_gate.bias": (ffn,)})
    return optional


def _qwen3_extra(g: GGUFInfo, shapes: dict, embd: int) -> str:
    """Qwen3-VL's encoder asserts on a missing patch bias or position embedding and on a class embedding;
    it resizes its learned positions from a square grid; deepstack tensors of no block are ignored."""
    if "v.class_embd" in shapes:
        return "it has a class embedding, which its encoder does not take"
    pos = tuple(shapes.get("v.position_embd.weight", ()))
    side = math.isqrt(pos[1]) if len(pos) == 2 else 0
    if len(pos) != 2 or pos[0] != embd or side == 0 or side * side != pos[1]:
        found = list(pos) if pos else "missing"
        return f"tensor v.position_embd.weight is {found}, not {embd} wide over a square grid of patches"
    blocks = int(g.get("clip.vision.block_count"))
    stray = sorted({n.split(".")[2] for n in shapes if n.startswith("v.deepstack.")
                    and not (n.split(".")[2].isdigit() and int(n.split(".")[2]) < blocks)})
    if stray:
        return f"it has deepstack tensors of block {stray[0]}, past its {blocks} blocks"
    return ""


def _qwen3_tensors(g: GGUFInfo, shapes: dict, embd: int, out: int) -> tuple[dict, dict]:
    """Fused qkv with bias, up/down never swapped (clip.cpp swaps only Qwen2's), deepstack mergers on the
    blocks that have an fc1 (clip.cpp counts those: each adds `out` to the output width)."""
    patch, merged = int(g.get("clip.vision.patch_size")), 4 * embd
    ffn = tuple(shapes.get("v.blk.0.ffn_up.weight", (embd, 0)))[-1]
    required: dict[str, tuple[int, ...]] = {
        "v.patch_embd.weight": (patch, patch, 3, embd), "v.patch_embd.weight.1": (patch, patch, 3, embd),
        "v.patch_embd.bias": (embd,), "mm.0.weight": (merged, merged), "mm.0.bias": (merged,),
        "mm.2.weight": (merged, out)}
    optional: dict[str, tuple[int, ...]] = {"v.post_ln.weight": (embd,), "v.post_ln.bias": (embd,),
                                            "v.pre_ln.weight": (embd,), "v.pre_ln.bias": (embd,)}
    for i in range(int(g.get("clip.vision.block_count"))):
        b = f"v.blk.{i}."
        required.update({b + "attn_qkv.weight": (embd, 3 * embd), b + "attn_qkv.bias": (3 * embd,),
                         b + "attn_out.weight": (embd, embd), b + "ffn_up.weight": (embd, ffn),
                         b + "ffn_down.weight": (ffn, embd)})
        optional.update(_block_optional(b, embd, ffn))
        d = f"v.deepstack.{i}."
        if d + "fc1.weight" in shapes:
            required.update({d + "fc1.weight": (merged, merged), d + "fc2.weight": (merged, out)})
            optional.update({d + "norm.weight": (merged,), d + "norm.bias": (merged,), d + "fc1.bias": (merged,),
                             d + "fc2.bias": (out,)})
    return required, optional


def _wanted(key: str) -> int | None:
    """The GGUF type clip.cpp reads a key with, by its name (None: not a scalar it asserts on)."""
    if not key.startswith("clip.") or key.endswith(("image_mean", "image_std", "pinpoints", "feature_layer",
                                                    "is_deepstack_layers",
                                                    "indexes", "spatial_offsets", "pattern_mode", "codebook_size")):
        return ARRAY if key.endswith(("image_mean", "image_std")) else None
    if "epsilon" in key or key.endswith("swiglu_clamp"):
        return F32
    if key.startswith(("clip.has_", "clip.use_")):
        return BOOL
    if key.endswith(("projector_type", "merge_type", "model_variant")):
        return STRING
    return I32 if key.endswith("minicpmv_version") else U32


def _compute(g: GGUFInfo) -> int:
    """One image's encoder buffers: f32 rows of its feed-forward and embedding widths per patch (libmtmd runs
    the encoder with flash attention where the backend has it: no attention scores held) and a fixed part.
    A SmolVLM-sized encoder (1,024 patches, 768 wide, 3,072 feed-forward): planned 38 MiB, clip.cpp reserved
    21 MiB on the CPU."""
    kind = _kind(g)
    patches = (int(g.get("clip.vision.image_size")) // max(int(g.get("clip.vision.patch_size")), 1)) ** 2
    if kind in QWEN_VL:  # images keep their size: the largest it takes
        patches = 4 * QWEN_MAX_TOKENS
    if kind in GEMMA4:
        patches = GEMMA4_TOKENS[1] * _gemma4_merge(g) ** 2
    embd = int(g.get("clip.vision.embedding_length"))
    # the tensors' width: Qwen2-VL's converter writes the text model's there, the first one 0
    ff = max((max(t.shape) for t in g.tensors if t.name == "v.blk.0.ffn_up.weight"),
             default=int(g.get("clip.vision.feed_forward_length", 0) or 0))
    # Qwen2.5-VL's window mask on the device: patches x patches f32 and its f16 copy for flash attention
    mask = 6 * patches * patches if kind == "qwen2.5vl_merger" else 0
    return ENCODER_FIXED + 4 * patches * (2 * max(ff, embd) + 2 * embd) + mask
