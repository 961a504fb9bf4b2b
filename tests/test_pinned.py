"""State copies through a pinned buffer (a CUDA build's) and the writer that writes them: what can be
checked without a GPU. A state file read into a buffer on a pool of threads, each chunk hashed as it is
read, gives the bytes the mapped read gives and refuses what it refuses; a save the writer drops unwritten
lets its buffer go, and a session save never drops a prefix snapshot; the chat keeps a buffer only where
the model is on a GPU and host RAM has room for it twice. The copies themselves are measured on the H200
(docs/BENCHMARKS.md: Documents)."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import threading

import pytest

from localchat import runtime
from localchat.machine import profiles
from localchat.machine.models import model_info
from localchat.session import statefile
from localchat.session.background import BackgroundWriter
from localchat.session.statefile import StateRejected


def _state(tmp_path, payload: bytes):
    header = statefile.make_header(payload, "fp", {}, [1, 2, 3], "test")
    path = tmp_path / "s.state"
    path.write_bytes(statefile.encode(header) + payload)
    header, offset = statefile.read_header(path)
    return path, header, offset


def test_a_state_read_into_a_buffer_is_the_mapped_read_and_a_damaged_one_is_refused(tmp_path):
    payload = os.urandom(statefile.CHUNK * 2 + 12345)  # three chunks, the last one short
    path, header, offset = _state(tmp_path, payload)
    into = memoryview(bytearray(header.payload_size))
    read = statefile.read_payload_into(path, header, offset, into)
    assert bytes(read) == bytes(statefile.read_payload(path, header, offset)) == payload
    data = bytearray(path.read_bytes())
    data[offset + statefile.CHUNK + 7] ^= 1  # one bit in the middle chunk
    path.write_bytes(bytes(data))
    with pytest.raises(StateRejected, match="fails its checksum"):
        statefile.read_payload_into(path, header, offset, into)
    path.write_bytes(bytes(data[:-1]))
    with pytest.raises(StateRejected, match="truncated"):
        statefile.read_payload_into(path, header, offset, into)


def test_a_save_replaced_before_it_ran_lets_go_of_what_it_held_and_a_snapshot_is_never_replaced_by_a_save():
    writer = BackgroundWriter(lambda status: None)
    started, release, dropped, ran = threading.Event(), threading.Event(), [], []
    writer.submit(lambda: (started.set(), release.wait(10)), key="other")  # busy: the next jobs wait
    assert started.wait(10)
    writer.submit(lambda: ran.append("prefix"), key="prefix:a")
    writer.submit(lambda: ran.append("save 1"), dropped=lambda: dropped.append("save 1"))
    writer.submit(lambda: ran.append("save 2"), dropped=lambda: dropped.append("save 2"))  # replaces save 1
    release.set()
    assert writer.wait(10) and dropped == ["save 1"]  # save 2 ran: nothing of it to let go
    assert ran == ["prefix", "save 2"]  # the snapshot queued first was written, and first


def test_a_pinned_buffer_is_planned_only_on_a_gpu_with_room_for_it(demo_path):
    info = model_info(demo_path)
    cpu = runtime.plans_for_command(profiles.load("cpu"), info)[1].chat
    assert runtime.pinned_bytes(cpu) == 0  # a CPU's state copies are memcpys already
    card = runtime.plans_for_command(profiles.load("rtx3060"), info)[1].card
    assert card is not None and card.gpu
    size = runtime.pinned_bytes(card)
    assert card.kv_bytes < size < card.kv_bytes * 1.1 + (16 << 20)  # the whole KV and llama.cpp's layout
    tight = dataclasses.replace(card, host_room_bytes=card.host_bytes + size)  # less than twice its size free
    assert runtime.pinned_bytes(tight) == 0


def test_a_state_is_checked_by_crc32_chunks_and_one_written_with_sha256_chunks_still_loads(tmp_path):
    payload = os.urandom(statefile.CHUNK + 999)
    path, header, offset = _state(tmp_path, payload)
    assert header.digest == "crc32" and header.payload_chunk == statefile.CHUNK
    older = dataclasses.replace(header, digest="sha256",
                                payload_digest=statefile.chunked_digest(memoryview(payload), statefile.CHUNK, "sha256"))
    body = older.to_json()
    body["payload_sha256"] = body.pop("payload_digest")  # as the files written before crc32 name it
    del body["digest"]
    raw = json.dumps(body).encode()
    path.write_bytes(struct.pack("<4sII", statefile.MAGIC, 1, len(raw)) + raw + payload)  # format 1: no header CRC
    header, offset = statefile.read_header(path)
    assert header.digest == "sha256"
    into = memoryview(bytearray(header.payload_size))
    assert bytes(statefile.read_payload_into(path, header, offset, into)) == payload
    assert bytes(statefile.read_payload(path, header, offset)) == payload
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(StateRejected, match="fails its checksum"):
        statefile.read_payload(path, header, offset)
