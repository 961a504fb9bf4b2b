"""`localchat bench --document`: the time to the first token of a chat about a long document, the
first time (prefilled, its KV kept in the prefix store) and the second (its KV loaded from the store),
against a chat without a store; the rounds interleaved, each with an empty store.

Each chat starts from an empty KV, as a new process does; the model stays loaded (its load is not
part of a TTFT). The second chat reads a state file the first just wrote: from the page cache, as on
a machine with free memory; a cold disk adds the file's size over the disk's read speed.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from localchat import runtime
from localchat.chat import attaching
from localchat.session.lifecycle import Session
from localchat.session.sessiondir import SessionDir
from localchat.settings import Profile

QUESTION = "Which clause names the highest rent, and who pays it?"
NAMES = ("Maria Rossi", "Paolo Bianchi", "Giulia Verdi", "Luca Neri", "Anna Galli", "Marco Conti")
CITIES = ("Roma", "Milano", "Torino", "Napoli", "Bologna", "Firenze", "Genova")


def document(n_tokens: int, count: Callable[[str], int]) -> str:
    """A rental register of at most n_tokens (and nearly that): clauses that differ in names, places, figures."""
    lines = ["Rental register"] + [
        f"Clause {i}: {NAMES[i % 6]} rents the flat at Via {CITIES[i % 7]} {i * 7 % 190} for {800 + i * 37 % 900} "
        f"euros a month from {NAMES[(i + 3) % 6]}, deposit {i * 13 % 5 + 1} months, heating "
        f"{'included' if i % 3 else 'extra'}, notice {i % 4 + 1} months." for i in range(1, n_tokens // 20)]
    low, high = 1, len(lines)  # the most lines that fit, by bisection
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if count("\n".join(lines[:mid])) <= n_tokens else (low, mid - 1)
    return "\n".join(lines[:low]) + "\n"


def _chat(rt: runtime.Runtime, home: Path, name: str, doc: Path, store: bool) -> dict[str, Any]:
    """One new chat about the document: attach it, ask, and the turn's figures."""
    rt.engine.clear()
    rt.chat.new()
    os.environ["LOCALCHAT_HOME"] = str(home)
    session = SessionDir(name) if store else None
    if session:
        session.lock()
    ctl = Session(rt, session, lambda _: None, autosave=False)
    _ = ctl.kv.hasher.value  # waits for the model's hash (once per model per machine): not part of a chat's wait
    attaching.add(rt.chat, [str(doc)])
    st = ctl.turn(QUESTION)
    ctl.close()
    return {"ttft_s": st.ttft_s, "prefill_s": st.prefill_s, "cached": st.cached_tokens,
            "recomputed": st.recomputed_tokens, "store_tokens": st.prefix.prefix_store_tokens or 0,
            "threads_batch": st.decode.threads_batch,  # past 256 tokens llama.cpp's sums depend on it
            "reply": rt.chat.conv.messages[-1].tokens}


def run_document(profile: Profile, repeat: int, doc_tokens: int, reply_tokens: int,
                 report: Callable[[str], None]) -> dict[str, Any]:
    # no drafts: when one is tried depends on timing, and past 256 tokens a verified batch and a single
    # step part in the last bits, which would blur the replies' comparison (not the TTFT)
    rt = runtime.open_runtime(dataclasses.replace(profile, speculate="off"), lambda _: None)
    old_home = os.environ.get("LOCALCHAT_HOME")
    try:
        with tempfile.TemporaryDirectory(prefix="localchat-bench-doc-") as tmp:
            doc = Path(tmp) / "register.txt"
            doc.write_text(document(doc_tokens, lambda t: len(rt.engine.tokenize(t, special=False))))
            runs: dict[str, list[dict[str, Any]]] = {"no store": [], "first": [], "second": []}
            for r in range(repeat):
                home = Path(tmp) / f"home{r}"  # an empty store each round
                for kind in runs:
                    report(f"bench --document: {kind} chat, run {r + 1}/{repeat}")
                    runs[kind].append(_chat(rt, home, f"{kind.replace(' ', '-')}-{r}", doc, kind != "no store"))
            med = {k: statistics.median(x["ttft_s"] for x in v) for k, v in runs.items()}
            same = {k: all(a["reply"] == b["reply"] for a, b in zip(runs[k], runs["first"])) for k in runs}
            first = runs["first"][0]
            return {"model": rt.model.name, "n_ctx": rt.engine.n_ctx, "kv": rt.engine.config.type_k,
                    "prompt_tokens": first["cached"] + first["recomputed"], "repeat": repeat,
                    "ttft_s": {k: round(v, 4) for k, v in med.items()},
                    "second_over_first": round(med["second"] / med["first"], 4),
                    "second_over_no_store": round(med["second"] / med["no store"], 4),
                    "store_tokens": runs["second"][0]["store_tokens"],
                    "recomputed_second": runs["second"][0]["recomputed"],
                    # the loaded KV against the prefill that made it; a prefill without a store against one with
                    "same_reply_loaded": same["second"], "same_reply_no_store": same["no store"],
                    "runs": {k: [{a: b for a, b in x.items() if a != "reply"} for x in v] for k, v in runs.items()}}
    finally:
        if old_home is None:
            os.environ.pop("LOCALCHAT_HOME", None)
        else:
            os.environ["LOCALCHAT_HOME"] = old_home
        rt.close()


def summary(result: dict[str, Any]) -> list[str]:
    t = result["ttft_s"]
    return [f"a chat about a document (its first prompt: {result['prompt_tokens']:,} tokens): {result['model']}, "
            f"n_ctx {result['n_ctx']}, "
            f"KV {result['kv']}, medians of {result['repeat']}",
            f"  TTFT: no store {t['no store']:.3f} s; first chat (prefill, KV stored) {t['first']:.3f} s; "
            f"second chat (KV loaded) {t['second']:.3f} s = {result['second_over_first']}x the first",
            f"  second chat: {result['store_tokens']:,} tokens from the prefix store, {result['recomputed_second']} "
            f"evaluated; greedy reply as after its prefill: {result['same_reply_loaded']} (prefill without a store: "
            f"{result['same_reply_no_store']})"]
