"""Where llama.cpp puts the model over several devices, computed as it does: each device's share
(tensor_split, else its room), the layers each gets (llama-model.cpp's split points, in float32),
and each device's weights, KV and compute buffers at a given n_ctx."""

from __future__ import annotations

import struct
from bisect import bisect_right
from dataclasses import dataclass

from localchat.machine.models import ModelInfo


@dataclass(frozen=True)
class Card:
    """One device the model is spread over: a GPU of this machine, or an RPC server's device."""

    name: str  # CUDA0, RPC0, ...
    budget: int  # bytes the profile allows on it (an RPC device: what its server reported free)
    free: int = 0  # bytes free on it now (0: not read)
    local: bool = True  # a GPU of this process: our CUDA context and the backend's growth land on it
    endpoint: str = ""  # an RPC device's server
    from_profile: bool = False  # the profile's card as written, not read from this machine (its free memory unknown)


@dataclass(frozen=True)
class CardUse:
    """What the plan puts on one device at one n_ctx."""

    name: str
    layers: int  # repeating layers on it (the output layer counts one more)
    output: bool  # holds the output projection (and the logits)
    weights: int
    kv: int
    compute: int


def f32(x: float) -> float:
    """x rounded to float32, as llama.cpp's split points are."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


def split_points(shares: list[float]) -> list[float]:
    """llama_model::load_tensors: cumulative shares over their sum, in float32."""
    acc, points = 0.0, []
    for s in shares:
        acc = f32(acc + f32(s))
        points.append(acc)
    return [f32(p / acc) for p in points]


def layer_devices(n_layer: int, n_gpu_layers: int, shares: list[float]) -> list[int | None]:
    """For each repeating layer and then the output layer: the index of its device (None: the CPU)."""
    offloaded = n_layer + 1 if n_gpu_layers < 0 else min(n_gpu_layers, n_layer + 1)
    first = n_layer + 1 - offloaded
    points = split_points(shares) if shares else []
    out: list[int | None] = []
    for il in range(n_layer + 1):
        if il < first or not points:
            out.append(None)
            continue
        out.append(min(bisect_right(points, f32((il - first) / offloaded)), len(points) - 1))
    return out


def kv_on(m: ModelInfo, layers: list[int], n_ctx: int, type_k: str, type_v: str, swa_cells: int,
          flash_attn: bool) -> int:
    """KV bytes of the given layers at n_ctx (sliding-window layers hold their window's cells)."""
    per = m.kv_layer_bytes(type_k, type_v, flash_attn)
    return round(sum(per[i] * (swa_cells if m.swa_layers[i] else n_ctx) for i in layers))
