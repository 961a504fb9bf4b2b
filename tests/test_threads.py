"""Threads that fit the machine: the physical cores other processes leave free, re-checked between turns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from localchat.errors import ProfileError
from localchat.machine import threads
from localchat.machine.profiles import thread_count, with_overrides
from localchat.options import _int_or_auto as _threads
from localchat.runtime import load_profile


class FakeGauge:
    def __init__(self, busy: float):
        self.busy = busy

    def elapsed(self) -> float:
        return 10.0

    def others_busy(self, min_window: float = 0.0) -> float:
        return self.busy


def test_cpu_lists_and_usable_cores():
    assert threads._cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert 1 <= threads.usable_cores() <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize(("busy", "want"), [(0.0, 8), (0.4, 8), (0.6, 7), (1.0, 7), (2.6, 5), (30.0, 1)])
def test_auto_leaves_the_cores_other_processes_keep_busy(busy, want):
    choice = threads.ThreadFit(0, 0, cores=8, gauge=FakeGauge(busy)).choose()
    assert (choice.decode, choice.batch) == (want, want)
    assert "8 cores" in choice.why


def test_fixed_numbers_win_and_batch_threads_may_differ():
    assert threads.ThreadFit(3, 5, cores=8).choose() == threads.ThreadChoice(3, 5, "")
    assert not threads.ThreadFit(3, 5, cores=8).auto
    mixed = threads.ThreadFit(2, 0, cores=8, gauge=FakeGauge(1.0)).choose()
    assert (mixed.decode, mixed.batch) == (2, 7)


def test_a_reading_too_soon_after_the_last_keeps_the_choice():
    fit = threads.ThreadFit(0, 0, cores=4)
    first = fit.choose(min_window=0.2)
    assert fit.choose() is first  # a turn right after the last reading: nothing new to tell


def test_profile_and_command_line_take_auto_or_a_number():
    assert load_profile("cpu", {}).n_threads == "auto"
    assert thread_count("auto") == 0 and thread_count(3) == 3 and thread_count(0) == 0
    assert with_overrides(load_profile("cpu", {}), n_threads=2, n_threads_batch="auto").n_threads == 2
    with pytest.raises(ProfileError, match="--threads: 'many'"):
        with_overrides(load_profile("cpu", {}), n_threads="many")
    assert _threads("auto") == "auto" and _threads("4") == 4
    import argparse

    from localchat.options import overrides
    given = overrides(argparse.Namespace(n_threads=2))  # --threads 2: tokens and prompt batches
    assert given["n_threads"] == given["n_threads_batch"] == 2
    assert overrides(argparse.Namespace(n_threads=None)).get("n_threads_batch") is None  # the profile's stays


def test_a_busy_process_takes_a_thread_and_gives_it_back_when_it_stops(home, tmp_path, demo_path):
    """On the real demo model: beside a process spinning on a core, the chat decodes with one thread
    fewer; when it has stopped, the next turn takes the core back."""
    cores = threads.usable_cores()
    stats = tmp_path / "stats.jsonl"
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    chat = None
    try:
        time.sleep(1.0)
        chat = subprocess.Popen([sys.executable, "-m", "localchat", "--model", str(demo_path), "--no-session",
                                 "--temperature", "0", "--max-tokens", "16", "--stats-json", str(stats)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "LOCALCHAT_HOME": str(home)})
        assert chat.stdin is not None
        chat.stdin.write("Hello!\n")
        chat.stdin.flush()
        deadline = time.time() + 120
        while not (stats.exists() and stats.read_text().strip()) and time.time() < deadline:
            time.sleep(0.1)
        spinner.kill()
        time.sleep(5.0)  # idle: the next turn's reading is mostly this quiet spell
        out, err = chat.communicate("Tell me more.\n", timeout=120)
    finally:
        spinner.kill()
        if chat is not None and chat.poll() is None:
            chat.kill()
    assert chat.returncode == 0, err
    first, second = (json.loads(x) for x in stats.read_text().splitlines())
    assert first["threads"] == first["threads_batch"] == max(1, cores - 1)
    assert second["threads"] == cores


def test_the_load_is_read_in_idle_time_and_a_turn_right_after_reads_nothing(home, demo_path):
    """On the real demo model: the idle work ends with a reading of the load, so a message sent within
    the next second takes its thread count from it (no /proc reads after Enter); later, a turn reads again."""
    from localchat import runtime
    from localchat.session.lifecycle import THREADS_FRESH_S, Session
    rt = runtime.open_runtime(runtime.load_profile("cpu", {"temperature": 0.0, "max_tokens": 4, "n_ctx": 1024,
                                                           "model": str(demo_path)}), lambda t: None)
    try:
        gauge = rt.threads.gauge
        readings = []
        real = gauge.others_busy
        gauge.others_busy = lambda min_window=0.0: readings.append(time.monotonic()) or real(min_window)
        ctl = Session(rt, None, lambda t: None, autosave=False, background=True)  # the terminal UI's
        time.sleep(THREADS_FRESH_S / 2)
        while ctl.idle_step():
            pass
        assert len(readings) == 1  # the idle work ran out: the load read then
        time.sleep(0.3)  # a person's pause before Enter: past the kernel-tick rule, within THREADS_FRESH_S
        ctl.turn("Hi")
        assert len(readings) == 1  # the turn took it: nothing read on its way to the first token
        time.sleep(THREADS_FRESH_S + 0.1)
        ctl.turn("And again")
        assert len(readings) == 2  # too old: read again
        ctl.close()
    finally:
        rt.close()


ENGINE_THREAD_SLEEPS = r'''
import json, os, sys, threading
from localchat.engine import Engine, EngineConfig
from localchat.host.scheduler import Scheduler


class NoIdleWork:
    def idle_step(self): return False
    def due_in(self): return None
    def set_typed(self, text): pass


def sleeps():
    with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


def one_token_steps(engine):
    prompt, before = list(range(100, 133)), sleeps()
    engine.clear()
    for n in range(1, len(prompt) + 1):
        engine.prefill(prompt[:n])
    return (sleeps() - before) / len(prompt)


cpus = len(os.sched_getaffinity(0))
engine = Engine(EngineConfig(sys.argv[1], n_ctx=512, n_threads=cpus, n_threads_batch=cpus))
engine.check_finite()  # on this thread, as a chat's opening does
here = one_token_steps(engine)
scheduler = Scheduler(NoIdleWork())
there = scheduler.call(lambda: one_token_steps(engine)).result()
scheduler.close()
print(json.dumps({"main": here, "engine_thread": there}))
'''


def test_the_engines_thread_computes_without_sleeping_at_every_barrier(demo_path):
    """On the real demo model, every CPU a thread: the opening computes on the main thread, then the terminal UI's
    engine thread decodes. llama.cpp's OpenMP threads kept for the main thread made libgomp count more threads than
    CPUs, and then every barrier of every step slept in the kernel (about 240 sleeps a token for the 1.5B, its decode
    0.79x line mode's); the main thread's team is let go as the engine changes hands."""
    out = subprocess.run([sys.executable, "-c", ENGINE_THREAD_SLEEPS, str(demo_path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    sleeps = json.loads(out.stdout.strip().splitlines()[-1])
    assert sleeps["main"] < 5
    assert sleeps["engine_thread"] < 5, sleeps


def test_a_turn_reads_the_load_again_only_where_layers_run_on_the_cpu(home, demo_path, monkeypatch):
    """A turn of the real demo model on the CPU reads the other processes' load on its way to the first token
    (auto threads); where every layer is on a GPU the CPU threads have next to nothing to do, and the turn does
    not spend the two /proc reads (0.26 ms on an H100 machine) on it."""
    import dataclasses

    from localchat import runtime
    from localchat.session.lifecycle import Session
    from localchat.session.sessiondir import SessionDir

    rt = runtime.open_runtime(runtime.load_profile("cpu", {"model": str(demo_path), "n_ctx": 512,
                                                           "max_tokens": 4, "temperature": 0}), lambda text: None)
    ctl = Session(rt, SessionDir("t"), lambda text: None, autosave=False)
    refits: list[float] = []
    monkeypatch.setattr(rt, "refit_threads", lambda min_window=0.0, fresh=0.0: refits.append(fresh))
    try:
        assert rt.threads is not None and rt.threads.auto and not rt.all_on_gpu
        ctl.turn("Name a colour.")
        assert len(refits) == 1
        rt.plan = dataclasses.replace(rt.plan, gpu=True, layers_gpu=rt.plan.layers_total)
        assert rt.all_on_gpu
        ctl.turn("Name a fruit.")
        assert len(refits) == 1
    finally:
        ctl.close()
        rt.close()
