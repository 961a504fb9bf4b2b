"""A model over several devices (issue 18): split profiles validated before loading, the plan per
device as llama.cpp places layers and allocates buffers (checked against recorded two-H200 runs),
RPC servers checked and asked for memory in their own protocol, and what the status bar shows."""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
import threading
from pathlib import Path

import pytest

from localchat import runtime
from localchat.errors import ProfileError
from localchat.machine import plan as planmod
from localchat.machine import planview, profiles, rpc
from localchat.machine.models import ModelInfo
from localchat.machine.placement import Card, layer_devices
from localchat.ui import status
from tests.gguf_writer import llama_shape, write_gguf

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30


def _profile(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "split.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, error", [
    ("extends: rtx3060x2\ntensor_split: [1, 1, 1]\n", r"tensor_split has 3 shares for 2 devices"),
    ("extends: rtx3060x2\ntensor_split: [1, -1]\n", r"key 'tensor_split' is out of range"),
    ("extends: rtx3060x2\ntensor_split: [0, 0]\n", r"key 'tensor_split' is out of range"),
    ("extends: rtx3060x2\nsplit_mode: rows\n", r"key 'split_mode' .* one of none, layer, row"),
    ("extends: rtx3060x2\nmain_gpu: 2\n", r"main_gpu 2 is not one of the profile's 2 GPUs"),
    ("extends: cpu\nrpc_servers: [\"10.0.0.2:50052\"]\n", r"rpc_servers take layers only when n_gpu_layers"),
    ("extends: rtx3060x2\nsplit_mode: row\nrpc_servers: [\"10.0.0.2:50052\"]\ntensor_split: [1, 1, 1]\n",
     r"row splits matrices over local CUDA GPUs only"),
    ("extends: rtx3060x2\ngpus: 0\n", r"key 'gpus' is out of range"),
])
def test_split_profiles_are_checked_before_anything_loads(tmp_path, text, error):
    with pytest.raises(ProfileError, match=error):
        profiles.load(str(_profile(tmp_path, text)))


def test_shipped_two_card_profiles_load():
    for name, gb in (("rtx3060x2", 12), ("rtx4060x2", 8)):
        p = profiles.load(name)
        assert (p.gpus, p.split_mode, p.vram_gb, p.n_gpu_layers) == (2, "layer", gb, -1)
    both = profiles.load("rtx3060x2")
    rpc_too = profiles.with_overrides(both, rpc_servers=("192.168.1.20:50052",), tensor_split=(1.0, 2.0, 2.0))
    assert rpc_too.rpc_servers == ("192.168.1.20:50052",)


def test_layers_go_to_devices_as_llama_cpp_places_them():
    # llama-model.cpp: split points from the cumulative shares, layer il -> upper_bound(points, il / offloaded)
    even = layer_devices(32, -1, [1, 1])
    assert even[:17] == [0] * 17 and even[17:] == [1] * 16  # 17 layers, then 15 and the output layer
    assert layer_devices(32, -1, [3, 1]).count(0) == 25
    partial = layer_devices(32, 20, [1, 1])  # the first 13 layers stay on the CPU
    assert partial[:13] == [None] * 13 and partial.count(0) == 10 and partial.count(1) == 10


@pytest.fixture
def llama3_8b(tmp_path) -> ModelInfo:
    from localchat.machine.models import model_info
    shape = llama_shape(n_layer=32, n_embd=4096, n_head=32, n_kv=8, n_ff=14336, n_vocab=128256, n_ctx_train=131072)
    return model_info(write_gguf(tmp_path / "llama3-8b-q4km.gguf", **shape))


def test_two_12gb_cards_hold_twice_the_context_and_each_card_gets_its_row(llama3_8b):
    one = planmod.make_plan(profiles.load("rtx3060"), llama3_8b)
    two = planmod.make_plan(profiles.load("rtx3060x2"), llama3_8b)
    assert two.fits and [d.name for d in two.devices] == ["CUDA0", "CUDA1"] and two.split_mode == "layer"
    assert two.n_ctx == llama3_8b.n_ctx_train > one.n_ctx  # 131,072 tokens of q8_0 KV, one card: 82,944
    assert sum(d.weights_bytes for d in two.devices) == one.weights_gpu_bytes
    assert sum(d.kv_bytes for d in two.devices) == two.kv_bytes
    assert all(d.total_bytes <= d.room_bytes for d in two.devices)
    text = "\n".join(planview.describe(two))
    assert "CUDA0    17 layers" in text and "CUDA1    15 layers + output" in text


def test_auto_context_fits_the_tighter_card_and_the_shares_follow_the_room(llama3_8b):
    p = profiles.with_overrides(profiles.load("rtx4060x2"), type_k="f16", type_v="f16")
    budget = planmod.budget_bytes(p)
    even = planmod.make_plan(p, llama3_8b, cards=[Card("CUDA0", budget), Card("CUDA1", budget)])
    # the second card's desktop holds 3 GiB: it gets fewer layers, and n_ctx fits what both have
    tight = [Card("CUDA0", budget, 8 * GIB), Card("CUDA1", budget, 5 * GIB)]
    uneven = planmod.make_plan(p, llama3_8b, cards=tight)
    assert uneven.fits and uneven.n_ctx < even.n_ctx
    assert uneven.devices[0].layers > uneven.devices[1].layers
    assert uneven.devices[1].limited_by == "free memory"
    # the same cards with an even tensor_split: the small card runs out first
    forced = dataclasses.replace(p, tensor_split=(1.0, 1.0), n_ctx=even.n_ctx)
    plan = planmod.make_plan(forced, llama3_8b, cards=tight)
    assert not plan.fits and plan.devices[0].fits and not plan.devices[1].fits
    with pytest.raises(ProfileError, match=r"CUDA1 needs .* GiB at n_ctx \d+ \(15 layers.* its room is 5.26 GiB \(what is free there now.*"
                       r"largest that fits every device: f16: n_ctx \d+"):
        planmod.check_fits(plan, forced)


def _h200_8b() -> ModelInfo:
    """The random-weight Llama-3-8B shape of the GPU runs (../shared/gpu/make_model.py, SmolLM2 vocabulary)."""
    return ModelInfo(path=Path("8b-gqa"), name="8b-gqa", arch="llama", n_params=0, quant="Q4_K_M", file_size=0,
                     n_ctx_train=32768, n_layer=32, n_embd=4096, n_head_kv=(8,) * 32, head_dim_k=128,
                     head_dim_v=128, n_swa=0, swa_layers=(False,) * 32, head_dims_swa=(128, 128), kv_from=32,
                     has_chat_template=True, tensor_bytes=0,
                     layer_bytes=(0,) * 32, output_bytes=0, n_vocab=49152, n_head=32, n_ff=14336)


def test_each_devices_kv_and_compute_match_what_llama_cpp_allocated_on_two_h200s():
    """Recorded runs of scripts/split_check.py on two H200s (docs/data/gpu/split-8b-*.jsonl): the plan of today's
    code at each recorded n_ctx and KV type against llama.cpp's buffers per device, pipeline copies included."""
    rows = [json.loads(line) for f in sorted((ROOT / "docs" / "data" / "gpu").glob("split-8b-*.jsonl"))
            for line in f.read_text().splitlines() if line.startswith('{"profile": "h200x2"')]
    assert len(rows) >= 4
    for r in rows:
        p = profiles.with_overrides(profiles.load("h200x2"), type_k=r["kv"], type_v=r["kv"])
        plan = planmod.make_plan(p, _h200_8b(), n_ctx=r["plan"]["n_ctx"],
                                 cards=[Card("CUDA0", planmod.budget_bytes(p)), Card("CUDA1", planmod.budget_bytes(p))])
        for d in plan.devices:
            assert d.kv_bytes == r["buffers"]["KV"][d.name]
            compute = r["buffers"]["compute"][d.name]
            assert abs(d.compute_bytes - compute) / compute < 0.01, (r["kv"], r["plan"]["n_ctx"], d, compute)


# ---------------------------------------------------------------- RPC servers
class FakeRpcServer:
    """Answers HELLO, DEVICE_COUNT and GET_DEVICE_MEMORY as ggml's rpc-server does (protocol 7)."""

    def __init__(self, devices: list[tuple[int, int]], major: int = rpc.PROTO_MAJOR):
        self.devices, self.major = devices, major
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            while head := conn.recv(9, socket.MSG_WAITALL):
                cmd, size = struct.unpack("<BQ", head)
                payload = conn.recv(size, socket.MSG_WAITALL) if size else b""
                if cmd == rpc.CMD_HELLO:
                    reply = bytes([self.major, 0, 0, 0]) + bytes(rpc.CONN_CAPS)
                elif cmd == rpc.CMD_DEVICE_COUNT:
                    reply = struct.pack("<I", len(self.devices))
                else:
                    reply = struct.pack("<QQ", *self.devices[struct.unpack("<I", payload)[0]])
                conn.sendall(struct.pack("<Q", len(reply)) + reply)


def test_an_rpc_server_is_asked_for_its_devices_memory_in_its_protocol():
    server = FakeRpcServer([(10 * GIB, 12 * GIB), (6 * GIB, 8 * GIB)])
    found = rpc.probe(server.endpoint)
    assert [(d.index, d.free, d.total) for d in found] == [(0, 10 * GIB, 12 * GIB), (1, 6 * GIB, 8 * GIB)]


def test_an_rpc_server_of_another_protocol_or_none_at_all_is_one_line():
    with pytest.raises(ProfileError, match=r"speaks protocol 6\.0\.0, this llama.cpp 7\.x"):
        rpc.probe(FakeRpcServer([(GIB, GIB)], major=6).endpoint)
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(ProfileError, match=rf"RPC server 127.0.0.1:{port} does not answer as an rpc-server"):
        rpc.probe(f"127.0.0.1:{port}", timeout=2)
    with pytest.raises(ProfileError, match=r"not host:port"):
        rpc.probe("192.168.1.20")


def test_rpc_servers_at_public_addresses_need_the_users_consent():
    rpc.check_address("127.0.0.1:50052", allow_public=False)
    rpc.check_address("192.168.1.20:50052", allow_public=False)
    rpc.check_address("[fe80::1]:50052", allow_public=False)
    with pytest.raises(ProfileError, match=r"public address \(8\.8\.8\.8\).*unauthenticated and unencrypted.*--rpc-public"):
        rpc.check_address("8.8.8.8:50052", allow_public=False)
    rpc.check_address("8.8.8.8:50052", allow_public=True)


def test_the_plan_places_layers_on_rpc_devices_by_what_their_servers_have_free(llama3_8b):
    small, big = FakeRpcServer([(4 * GIB, 8 * GIB)]), FakeRpcServer([(12 * GIB, 16 * GIB)])
    p = profiles.with_overrides(profiles.load("cpu"), n_gpu_layers=-1, n_ctx=8192,
                                rpc_servers=(small.endpoint, big.endpoint))
    if not runtime.rpc_supported():  # this build: the one-line refusal with the install command
        with pytest.raises(ProfileError, match=r"need llama-cpp-python built with the RPC backend: CMAKE_ARGS="):
            runtime.effective_profile(p)
    plan = planmod.make_plan(p, llama3_8b, cards=runtime.cards_for(p))
    assert [d.name for d in plan.devices] == ["RPC0", "RPC1"] and plan.fits
    assert plan.devices[1].layers > 2 * plan.devices[0].layers  # 12 GiB free against 4 GiB
    assert plan.cuda_context_bytes == 0  # the servers' own CUDA contexts are already in what they report
    config = runtime.engine_config(p, llama3_8b, plan.n_ctx, False, 2, plan)
    assert config.devices == ("RPC0", "RPC1") and config.split_mode == "layer" and len(config.tensor_split) == 2


def test_one_gpu_profiles_name_their_one_device_and_cpu_profiles_none(llama3_8b):
    p = profiles.load("rtx3060")
    plan = planmod.make_plan(p, llama3_8b)
    config = runtime.engine_config(p, llama3_8b, plan.n_ctx, False, 2, plan)
    assert (config.devices, config.split_mode, config.tensor_split) == (("CUDA0",), "none", ())
    second = profiles.with_overrides(p, main_gpu=1)  # one card, the machine's second
    on_second = planmod.make_plan(second, llama3_8b)
    assert runtime.engine_config(second, llama3_8b, 4096, False, 2, on_second).devices == ("CUDA1",)
    cpu = profiles.load("cpu")
    assert runtime.engine_config(cpu, llama3_8b, 4096, False, 2, planmod.make_plan(cpu, llama3_8b)).devices == ()


def test_the_status_bar_shows_each_devices_memory_when_split():
    one = status.BarState(layers_gpu=33, layers_total=33)
    assert "| GPU 33/33 " in status.toolbar_text(one)
    split = dataclasses.replace(one, devices=(("CUDA0", int(9.6 * GIB), 11 * GIB), ("CUDA1", int(9.1 * GIB), 11 * GIB)))
    assert "| CUDA0 9.6/11G CUDA1 9.1/11G " in status.toolbar_text(split)


def test_a_profile_for_more_gpus_than_the_machine_has_stops_before_loading(monkeypatch):
    from localchat.engine import Device
    one = [Device("CUDA0", "NVIDIA GeForce RTX 3060", "gpu", 11 * GIB, 12 * GIB)]
    monkeypatch.setattr(runtime, "local_gpus", lambda: one)
    with pytest.raises(ProfileError, match=r"uses 2 GPU\(s\) from CUDA0, this machine has 1: CUDA0 \(NVIDIA GeForce "
                                           r"RTX 3060\); set gpus"):
        runtime.cards_for(profiles.load("rtx3060x2"))
    cards = runtime.cards_for(profiles.load("rtx3060"))
    assert [(c.name, c.free, c.local) for c in cards] == [("CUDA0", 11 * GIB, True)]


def test_rpc_devices_compute_covers_what_cpu_rpc_servers_allocated(demo_path):
    """Two CPU ggml-rpc-servers of llama-cpp-python 0.3.36 holding the demo model (scripts/rpc_e2e.sh's setup):
    llama.cpp's compute buffers per server at n_ctx 1024 and 4096, recorded from its log."""
    from localchat.machine.models import model_info
    allocated = {1024: (21_925_724, 110_803_026), 4096: (34_508_636, 123_385_938)}
    for n_ctx, (first, second) in allocated.items():
        p = profiles.with_overrides(profiles.load("cpu"), n_gpu_layers=-1, rpc_servers=("127.0.0.1:1", "127.0.0.1:2"))
        cards = [Card("RPC0", 20 * GIB, local=False, endpoint="127.0.0.1:1"),
                 Card("RPC1", 20 * GIB, local=False, endpoint="127.0.0.1:2")]
        plan = planmod.make_plan(p, model_info(demo_path), n_ctx=n_ctx, cards=cards)
        assert [d.output for d in plan.devices] == [False, True]
        assert first <= plan.devices[0].compute_bytes < 1.5 * first
        assert second <= plan.devices[1].compute_bytes < 1.25 * second
