"""A vision projector file (an mmproj GGUF) read before llama.cpp sees it: found beside its model the way
other tools name it, checked where clip.cpp would abort instead of failing (integers it reads as
uint32, floats as f32), and sized for the memory plan: its weights and its encoder's compute buffer."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from localchat.errors import ModelError
from localchat.machine.gguf_file import GGUFInfo, read_gguf

U32, I32, F32, BOOL, STRING, ARRAY = 4, 5, 6, 7, 8, 9
WANTED_TYPES = {U32: "uint32", I32: "int32", F32: "float32", BOOL: "bool", STRING: "string", ARRAY: "array"}
MAX_BLOCKS = 1024
FIXED_SIZE = ("gemma3", "idefics3")  # projector types whose images are resized to image_size, in patches
SHARED_START = 6  # characters two names share at their start to be taken as one model's files
ENCODER_FIXED = 8 << 20  # clip.cpp's graph and input staging beside the activations
REQUIRED = ("clip.vision.image_size", "clip.vision.patch_size", "clip.vision.embedding_length",
            "clip.vision.block_count", "clip.vision.attention.head_count")


@dataclass(frozen=True)
class ProjectorInfo:
    path: Path
    kind: str  # clip.projector_type: gemma3, idefics3, ...
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
    for key in (*REQUIRED, "clip.projector_type"):
        if key not in g.metadata:
            raise ModelError(f"{name} lacks {key}: it is damaged or was written by an unknown converter")
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
    return ProjectorInfo(path, str(g.get("clip.projector_type")), weights, _compute(g))


def _shape_problem(g: GGUFInfo) -> str:
    """What of the vision encoder's sizes and tensors does not hold together ("" when all does): the parts
    every ViT projector shares, and the projection of the types localchat is tested with."""
    embd, heads = int(g.get("clip.vision.embedding_length")), int(g.get("clip.vision.attention.head_count"))
    size, patch = int(g.get("clip.vision.image_size")), int(g.get("clip.vision.patch_size"))
    if heads <= 0 or embd % heads:
        return f"clip.vision.attention.head_count {heads} does not divide its width {embd}"
    if str(g.get("clip.projector_type")) in FIXED_SIZE and (size <= 0 or patch <= 0 or size % patch):
        return f"clip.vision.image_size {size} is not a multiple of its patch size {patch}"
    blocks = int(g.get("clip.vision.block_count"))
    if not 0 <= blocks <= MAX_BLOCKS:
        return f"clip.vision.block_count {blocks} is past any encoder's (at most {MAX_BLOCKS})"
    shapes = {t.name: t.shape for t in g.tensors}
    side = size // patch if patch > 0 else 0
    wanted = {"v.patch_embd.weight": (patch, patch, 3, embd), "v.position_embd.weight": (embd, side * side)}
    for i in range(blocks):
        wanted.update({f"v.blk.{i}.attn_{w}.weight": (embd, embd) for w in ("q", "k", "v", "out")})
        wanted.update({f"v.blk.{i}.{n}.weight": (embd,) for n in ("ln1", "ln2")})
    merge = int(g.get("clip.vision.projector.scale_factor", 1) or 1)
    if str(g.get("clip.projector_type")) == "gemma3" and "mm.input_projection.weight" in shapes:
        wanted["mm.input_projection.weight"] = (shapes["mm.input_projection.weight"][0], embd)
    if str(g.get("clip.projector_type")) == "idefics3" and "mm.model.fc.weight" in shapes:
        wanted["mm.model.fc.weight"] = (embd * merge * merge, shapes["mm.model.fc.weight"][-1])
    for tensor, shape in wanted.items():
        if tensor in shapes and tuple(shapes[tensor]) != shape:
            return f"tensor {tensor} has the shape {list(shapes[tensor])}, its sizes say {list(shape)}"
    return ""


def _wanted(key: str) -> int | None:
    """The GGUF type clip.cpp reads a key with, by its name (None: not a scalar it asserts on)."""
    if not key.startswith("clip.") or key.endswith(("image_mean", "image_std", "pinpoints", "feature_layer",
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
    patches = (int(g.get("clip.vision.image_size")) // max(int(g.get("clip.vision.patch_size")), 1)) ** 2
    embd = int(g.get("clip.vision.embedding_length"))
    ff = int(g.get("clip.vision.feed_forward_length", 0) or 0)
    return ENCODER_FIXED + 4 * patches * (2 * max(ff, embd) + 2 * embd)
