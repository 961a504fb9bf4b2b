"""The benchmark's modes, each replaying the same token sequences: the real engine path with
autosave (`localchat`), the resume test, full re-prefill (`recompute`), plain llama-cpp-python
(`raw`), llama-server (`server`), and the last turn again with the modes interleaved."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from localchat import runtime
from localchat.bench.peer import PeerServer
from localchat.engine import Engine, Generation, PrefillResult, SamplingConfig
from localchat.session.kvdisk import read_saved
from localchat.session.lifecycle import Session
from localchat.session.sessiondir import SessionDir

if TYPE_CHECKING:  # its module loads llama-cpp-python's high-level API: only where the raw mode runs
    from localchat.bench.rawbaseline import RawLlama

LOAD_WINDOW_S = 0.3  # a user's moment between turns, as the idle time's readings (every 0.5 s) see it
FILLER = ("The history of bread begins with wild grains ground on stones, baked on hot ashes, and shared "
          "among families who learned that a little old dough makes the next loaf rise. ")


@dataclass
class Row:
    mode: str
    kv: str
    turn: int
    prompt_tokens: int
    recomputed_tokens: int
    ttft_s: float
    prefill_s: float
    decode_tps: float
    wall_s: float = 0.0
    save_s: float = 0.0
    repeat: int = 0  # 0: the run itself; k: the k-th interleaved repeat of the last turn
    threads: int = 0  # localchat's prompt threads for the turn (auto: what the load left free)


def text_of(engine: Engine, n_tokens: int, salt: str) -> str:
    """Text that tokenizes to about n_tokens tokens."""
    toks = engine.tokenize((salt + " " + FILLER) * (n_tokens // 20 + 2), special=False)[:n_tokens]
    return engine.detokenize(toks)


def _anon_rss() -> int:
    m = psutil.Process().memory_info()
    return m.rss - m.shared


def run_localchat(rt: runtime.Runtime, args, users: list[str], home: Path, kv: str, progress,
                  peers: Peers | None = None) -> dict:
    """The real engine path with autosave on; records every prompt for the other modes. `peers` replay each
    turn right after it (the machine's drift over minutes falls on every mode alike), once its save is written."""
    store = SessionDir(f"bench-{kv}", home / "sessions")
    store.lock()
    ctl = Session(rt, store, lambda t: None, autosave=True)
    rows, prompts, replies = [], [], []
    rss0 = _anon_rss()
    peak = rss0
    resume = {}
    for i, text in enumerate(users, 1):
        if i == args.turns // 2 + 1:
            ctl.writer.wait()
            resume = _resume(rt, ctl, store)
        user_pause(rt)
        t0 = time.perf_counter()
        st = ctl.turn(text)
        window = ctl.chat.conv.window_tokens()
        prompts.append(window[:st.prompt_tokens])
        replies.append(window[st.prompt_tokens:])
        ctl.after_turn(st)
        wall = time.perf_counter() - t0
        rows.append(Row("resume" if resume else "localchat", kv, i, st.prompt_tokens, st.recomputed_tokens,
                        st.ttft_s, st.prefill_s, st.decode_tps, wall, st.save_s, threads=st.decode.threads_batch or 0))
        peak = max(peak, _anon_rss())
        progress(f"localchat {kv} turn {i}")
        if peers is not None:
            ctl.writer.wait()
            peers.replay(i, prompts[-1], replies[-1])
    ctl.writer.wait()
    state_size = store.state.stat().st_size
    ctl.close()
    return {"rows": rows, "prompts": prompts, "replies": replies, "resume": resume, "state_bytes": state_size,
            "host_overhead_bytes": peak - rss0}


def user_pause(rt: runtime.Runtime) -> None:
    """What the user's reading and typing gives the chat before a turn: a GPU's queued work done (the head
    warmed, a history prefilled: a turn timed right after it would wait for work no user waits for), and the
    load other processes put on the machine read over the last moment, as the terminal UI's idle time reads
    it: with auto threads, a window spanning the peers' replay of the turn before would count their work as
    load now and leave localchat one thread on two cores."""
    rt.engine.synchronize()
    rt.refit_threads()  # closes the window that held the peers' work
    rt.refit_threads(min_window=LOAD_WINDOW_S)


def _first_token(engine: Engine, tokens: list[int], t0: float, sampler) -> tuple[PrefillResult, float]:
    """Make the KV hold `tokens` and sample one token of the continuation; seconds since t0."""
    pre = engine.prefill(tokens)
    gen = Generation(tokens=[])
    for _ in engine.generate(sampler, 1, gen):
        pass
    engine.truncate(len(tokens))  # the sampled token was never evaluated: nothing to rewind
    return pre, gen.first_token_at - t0


def _resume(rt: runtime.Runtime, ctl: Session, store: SessionDir) -> dict:
    """Drop the KV (as a new process would have none), time both ways back, then resume for real."""
    engine = rt.engine
    draw = engine.make_sampler(ctl.chat.settings.sampling)  # the chat's (temperature 0 here), see run_recompute
    window = ctl.chat.conv.window_tokens()
    ctl.save()  # as a clean exit does
    ctl.writer.wait()
    engine.clear()
    t0 = time.perf_counter()
    engine.prefill(window)
    prefill_s = time.perf_counter() - t0
    _, reprefill_first = _first_token(engine, window, t0, draw)
    engine.clear()
    ctl.chat.adopt(store.conversation())
    t0 = time.perf_counter()
    ctl.resume()
    resume_s = time.perf_counter() - t0
    chose_restore = ctl.restored
    t0 = time.perf_counter()
    saved = read_saved(store.state)  # the base and the saves after it, as a resume reads them
    ctl.kv.load_saved(saved)
    load_s = time.perf_counter() - t0
    _, restore_first = _first_token(engine, window, t0, draw)
    ctl.note_restored()
    ctl.chat.ahead.drop_warm()  # the timed load replaced the KV that resume() had warmed
    ctl.chat.ahead.warm_next_head()
    faster = "restore" if load_s < prefill_s else "re-prefill"
    chosen = "restore" if chose_restore else "re-prefill"
    return {"tokens": len(window), "state_bytes": saved.size, "load_s": load_s, "reprefill_s": prefill_s,
            # from nothing in memory to the first token of the continuation, each way
            "restore_first_token_s": restore_first, "reprefill_first_token_s": reprefill_first,
            "chosen": chosen, "faster": faster, "resume_s": resume_s, "note": ctl.restore_note,
            "chosen_within_10pct": chosen == faster or min(load_s, prefill_s) * 1.1 >= max(load_s, prefill_s)}


def run_recompute(engine: Engine, sampling: SamplingConfig, prompts: list[list[int]], replies: list[list[int]],
                  kv: str, progress, ram: dict) -> list[Row]:
    """Also measures the decode path's host RAM beyond llama.cpp's buffers (no autosave here). Drawn as the chat
    draws (`sampling`, its penalties too): a greedy draw alone goes in llama.cpp's graph on a GPU, and the chat's
    next turn would pay for moving it out again, as no user's turn does. The penalties see what this sampler drew
    before, not each prompt: its tokens may differ from the chat's, their cost does not."""
    rows = []
    engine.clear()
    engine.prefill(prompts[0][:8])  # llama.cpp's buffers are all allocated by the first decode
    rss0 = peak = _anon_rss()
    sampler = engine.make_sampler(sampling)
    for i, (prompt, n) in enumerate(zip(prompts, replies), 1):
        engine.clear()
        engine.reset_perf()
        t0 = time.perf_counter()
        pre = engine.prefill(prompt)
        gen = Generation(tokens=[])
        for _ in engine.generate(sampler, max(len(n), 1), gen):
            pass
        perf = engine.perf()
        tps = perf["eval_n"] / (perf["eval_ms"] / 1000) if perf["eval_ms"] else 0.0
        rows.append(Row("recompute", kv, i, len(prompt), pre.recomputed, gen.first_token_at - t0, pre.seconds, tps,
                        time.perf_counter() - t0))
        peak = max(peak, _anon_rss())
        progress(f"recompute {kv} turn {i}")
    engine.clear()
    ram["decode_path_host_overhead_mb"] = round((peak - rss0) / 1e6, 1)
    return rows


class Peers:
    """Plain llama-cpp-python (`raw`) and llama-server, each replaying localchat's turns with its own cache; a
    peer that fails is dropped, its error kept (the peer failing must not lose our figures)."""

    def __init__(self, raw: RawLlama | None, server: PeerServer | None, kv: str, progress) -> None:
        self.raw, self.server, self.kv, self.progress = raw, server, kv, progress
        self.rows: list[Row] = []
        self.errors: list[str] = []

    def replay(self, i: int, prompt: list[int], reply: list[int]) -> None:
        if self.raw is not None:
            try:
                ttft, tps, evaluated = self.raw.turn(prompt, reply)
                self.rows.append(Row("raw", self.kv, i, len(prompt), evaluated, ttft, 0.0, tps))
                self.progress(f"raw llama-cpp-python {self.kv} turn {i}")
            except (ValueError, RuntimeError) as exc:
                self.errors.append(f"raw llama-cpp-python: {exc}")
                self.raw = None
        if self.server is not None:
            try:
                r = self.server.completion(prompt, max(len(reply), 1))
                self.rows.append(Row("server", self.kv, i, len(prompt), r["prompt_n"], r["ttft_s"],
                                     r["prompt_ms"] / 1000, r["decode_tps"]))
                # its cache to the reply the conversation goes on with (its own drew no penalties: it differs), so
                # its next turn evaluates what localchat's does, not the reply too, as a client sending back its own
                self.server.completion(prompt + reply, 1)
                self.progress(f"llama-server {self.kv} turn {i}")
            except (OSError, RuntimeError, ValueError) as exc:
                self.errors.append(f"llama-server: {exc}")
                self.server = None


def repeat_last_turn(rt: runtime.Runtime, last_text: str, prompts: list[list[int]], replies: list[list[int]],
                     raw, server: PeerServer | None, kv: str, rounds: int, progress) -> list[Row]:
    """The last turn again, `rounds` times, the modes interleaved within each round, so that a
    slow spell of the machine hits every mode alike; the summary takes medians."""
    chat, engine = rt.chat, rt.engine
    prompt, reply = prompts[-1], replies[-1]
    chat.undo()  # back to the conversation before the last turn; recompute cleared the KV
    before = chat.conv.window_tokens()
    sampler = engine.make_sampler(chat.settings.sampling)  # see run_recompute
    rows = []
    for k in range(1, rounds + 1):
        engine.prefill(before)  # the state after the previous turn (later rounds: a rewind of what recompute left)
        chat.ahead.warm_next_head()  # as after_turn does once a reply has been shown
        user_pause(rt)
        st = chat.turn(last_text)
        rows.append(Row("resume", kv, len(prompts), st.prompt_tokens, st.recomputed_tokens, st.ttft_s, st.prefill_s,
                        st.decode_tps, repeat=k, threads=engine.threads[1]))
        chat.undo()
        progress(f"last turn again {k}/{rounds}: localchat {kv}")
        engine.clear()
        t0 = time.perf_counter()
        pre, ttft = _first_token(engine, prompt, t0, sampler)
        rows.append(Row("recompute", kv, len(prompts), len(prompt), pre.recomputed, ttft, pre.seconds, 0.0,
                        repeat=k))
        progress(f"last turn again {k}/{rounds}: recompute {kv}")
        if raw is not None:
            ttft, tps, evaluated = raw.turn(prompt, reply, keep=len(before))
            rows.append(Row("raw", kv, len(prompts), len(prompt), evaluated, ttft, 0.0, tps, repeat=k))
            progress(f"last turn again {k}/{rounds}: raw {kv}")
        if server is not None:
            server.completion(before, 1)  # its cache back to the previous turn's tokens
            r = server.completion(prompt, max(len(reply), 1))
            rows.append(Row("server", kv, len(prompts), len(prompt), r["prompt_n"], r["ttft_s"], r["prompt_ms"] / 1000,
                            r["decode_tps"], repeat=k))
            progress(f"last turn again {k}/{rounds}: llama-server {kv}")
    engine.clear()
    return rows
