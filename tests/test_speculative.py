"""Speculative decoding from the context's own history: the same replies, fewer steps."""

from __future__ import annotations

import copy
import json
import math
from collections import Counter

import llama_cpp as lc
import numpy as np
import pytest

from localchat.chat.request import TurnSink
from localchat.chat.turns import Chat, ChatSettings
from localchat.engine import Generation, SamplingConfig
from localchat.engine.backend import SEQ
from localchat.engine.sampling import _chain, drawer, is_greedy, logits, prime
from localchat.engine.speculative import DRAFT_MAX, PRIOR, Speculation
from localchat.engine.stepcost import StepCost
from localchat.runtime import chat_format
from tests.conftest import make_engine, run_cli
from tests.ggufedit import first_layers

NOTE = ("The committee met on Tuesday to review the budget for the new library. After a long discussion, "
        "they agreed to fund the children's section, the reading room and the archive, but not the cafe. ")
QUESTIONS = ["Here is a note: " + NOTE * 2 + "\nRepeat the note word for word.", "Now repeat it again exactly.",
             "Say it once more."]


def _chat(engine, speculate: str, temperature: float = 0.0, seed: int = 7, max_tokens: int = 96) -> Chat:
    engine.clear()
    return Chat(engine, chat_format(engine), ChatSettings(
        max_tokens=max_tokens, speculate=speculate, sampling=SamplingConfig(temperature=temperature, seed=seed)))


def _kv_consistent(e) -> None:
    assert e.n_kv <= len(e.tokens) <= e.n_kv + 1  # at most the last token pending
    assert lc.llama_memory_seq_pos_max(e.mem, SEQ) == e.n_kv - 1  # no rejected draft left in the KV


def test_greedy_replies_are_token_identical_with_drafts_and_take_fewer_steps(demo_engine):
    plain = _chat(demo_engine, "off")
    plain_stats = [plain.turn(q) for q in QUESTIONS]
    drafted = _chat(demo_engine, "on")
    stats = [drafted.turn(q) for q in QUESTIONS]
    _kv_consistent(demo_engine)
    assert drafted.speculation.cost is demo_engine.step_cost  # what the steps cost is the engine's, for every chat
    assert [m.tokens for m in drafted.conv.messages] == [m.tokens for m in plain.conv.messages]
    assert sum(st.drafts.accepted_tokens for st in stats) > 40  # the reply quotes the note: drafts hold
    # each kept draft token is one single-token step fewer (llama.cpp's own decode counter)
    assert sum(st.llama_eval for st in stats) < sum(st.llama_eval for st in plain_stats) - 40
    assert [st.llama_prompt_eval for st in stats] == [st.llama_prompt_eval for st in plain_stats]


def _draws(engine, prompt: list[int], seeds: range, spec_on: bool) -> tuple[Counter, int, int]:
    """The 2nd and 3rd tokens after `prompt` (the first drafted positions), one reply per seed."""
    seen: Counter = Counter()
    drafted = accepted = 0
    for seed in seeds:
        engine.prefill(prompt)
        sampler = engine.make_sampler(SamplingConfig(temperature=2.0, top_k=8, top_p=1.0, min_p=0.0, seed=seed))
        spec = Speculation("on") if spec_on else None
        gen = Generation(tokens=[])
        for _ in engine.generate(sampler, 3, gen, spec=spec):
            pass
        seen[tuple(gen.tokens[1:3])] += 1
        if spec:
            drafted, accepted = drafted + spec.drafted, accepted + spec.accepted
    return seen, drafted, accepted


def test_sampled_replies_keep_their_distribution(demo_engine):
    """At temperature > 0 a draft token is kept where the sampler draws it and a rejected position is
    drawn from the rest: the replies follow the distribution they have without drafts."""
    demo_engine.clear()
    prompt = demo_engine.tokenize(NOTE * 2 + "The committee met on", special=False)
    plain, _, _ = _draws(demo_engine, prompt, range(1, 301), spec_on=False)
    drafted, n_drafted, n_accepted = _draws(demo_engine, prompt, range(1001, 1301), spec_on=True)
    assert 0.3 < n_accepted / n_drafted < 0.95  # both branches of the rule ran: drafts kept and rejected
    top = plain.most_common(1)[0][0]  # the continuation the drafts propose
    p1, p2, n = plain[top] / 300, drafted[top] / 300, 300
    pooled = (p1 + p2) / 2
    z = (p2 - p1) / math.sqrt(2 * pooled * (1 - pooled) / n)
    assert abs(z) < 4, (p1, p2)  # keeping every draft would make p2 near 1 (z above 10)
    total_variation = sum(abs(plain[k] - drafted[k]) for k in set(plain) | set(drafted)) / 600
    assert total_variation < 0.4  # two plain runs of 300 differ by about 0.25 here


def test_undo_resume_and_a_stop_mid_draft_keep_the_kv_exact(demo_engine):
    e = demo_engine
    plain = _chat(e, "off")
    for q in QUESTIONS[:2]:
        plain.turn(q)
    chat = _chat(e, "on")
    chat.turn(QUESTIONS[0])
    saved, saved_tokens, saved_conv = bytes(e.state_bytes()), e.tokens[:e.n_kv], copy.deepcopy(chat.conv)
    chat.turn("Something else entirely: name three colours.")
    chat.undo()
    chat.turn(QUESTIONS[1])
    assert [m.tokens for m in chat.conv.messages] == [m.tokens for m in plain.conv.messages]
    resumed = _chat(e, "on")
    assert e.load_state(saved, saved_tokens)
    resumed.adopt(saved_conv)
    resumed.turn(QUESTIONS[1])
    assert [m.tokens for m in resumed.conv.messages] == [m.tokens for m in plain.conv.messages]
    # Ctrl-C while a verified draft is ahead of what was shown: the KV holds exactly the reply kept
    stopped = _chat(e, "on")
    stopped.turn(QUESTIONS[0])
    count = [0]

    def cancel_soon() -> bool:
        count[0] += 1
        return count[0] > 5

    st = stopped.turn(QUESTIONS[1], TurnSink(cancelled=cancel_soon))
    assert st.cut and st.drafts.draft_tokens > 0
    _kv_consistent(e)
    assert e.tokens == stopped.conv.window_tokens()


@pytest.mark.parametrize("overlaps", [True, False])
def test_a_reply_cut_while_its_next_token_is_evaluated_keeps_the_kv_exact(demo_engine, overlaps):
    """Where the backend computes after llama_decode returns (a GPU), the next token's evaluation starts
    before the text is handed out: a reply cut there keeps its last token evaluated. On a CPU the text
    goes first: the cut reply's last token is pending. Either way the next turn goes on as from a clean
    prefill."""
    e = demo_engine
    chat = _chat(e, "off")
    count = [0]

    def cancel_soon() -> bool:
        count[0] += 1
        return count[0] > 5

    e.overlaps = overlaps  # the GPU's order on this CPU: the same tokens, only the text comes later
    try:
        # a short chat: llama.cpp's arithmetic is then the same for a batch as for single tokens (docs/profiles.md: Speed)
        assert chat.turn("Say hello to my friend Tom.", TurnSink(cancelled=cancel_soon)).cut
        _kv_consistent(e)
        held = len(chat.conv.window_tokens()) - (not overlaps)
        assert e.n_kv == held and len(e.tokens) == len(chat.conv.window_tokens())  # shown, kept; evaluated
        cut_conv = copy.deepcopy(chat.conv)
        st = chat.turn("Name three colours.")
        assert st.cached_tokens == held  # an evaluated last token is not evaluated again
    finally:
        e.overlaps = False
    fresh = _chat(e, "off")
    fresh.adopt(cut_conv)
    fresh.turn("Name three colours.")
    assert fresh.conv.messages[-1].tokens == chat.conv.messages[-1].tokens


def _certain(spec: Speculation) -> Speculation:
    """Every draft token holds and a batch costs as much as one token."""
    spec.cost.jump, spec.cost.slope = 0.0, 0.01
    spec._kept, spec._missed = dict.fromkeys(spec._kept, 100.0), dict.fromkeys(spec._missed, 0.01)
    return spec


def test_the_ngram_index_drafts_what_followed_last_time():
    spec = _certain(Speculation("on"))
    history = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert spec.draft(history, 8) == [4, 5, 9, 9, 1, 2, 3]
    history += [4, 7, 1, 2, 3]  # the latest continuation of 1 2 3 is now 4 7
    assert spec.draft(history, 2) == [4, 5]  # what the newest tokens teach is learnt once their step is under way
    spec.learn(history)
    assert spec.draft(history, 2) == [4, 7]
    assert spec.draft([8, 8, 8, 6], 4) == []  # a new list is indexed afresh: no 8 8 6 seen before
    assert len(spec.draft(list(range(1, 41)) * 2, 64)) == DRAFT_MAX  # a batch past 8 switches CUDA kernels


def test_the_draft_is_as_long_as_pays_on_this_machine_and_the_text():
    quote = list(range(1, 41))
    long_match = quote + [99] + quote[:36]  # the last 36 tokens agree with the start: a quote under way
    short_match = quote + [99] + [50, 51, 52, 53, 54, 55, 36, 37, 38, 39]  # only 36-39 agree: a coincidence
    gpu, cpu = Speculation("auto"), Speculation("auto")
    gpu.cost.jump, gpu.cost.slope = 0.08, 0.08  # the batch costs measured on an H200 (demo model)
    cpu.cost.jump, cpu.cost.slope = 0.34, 0.47  # and on the 2-core VM
    assert len(cpu.draft(long_match, 16)) < len(gpu.draft(long_match, 16)) == DRAFT_MAX
    assert cpu.draft(short_match, 16) == [] and len(gpu.draft(short_match, 16)) > 0
    assert cpu.best_length([0.95] * DRAFT_MAX)[1] > 1.3 and gpu.best_length([0.95] * DRAFT_MAX)[1] > 3
    hopeless = Speculation("auto")
    hopeless._kept = dict.fromkeys(hopeless._kept, 0.0)  # nothing has held
    assert hopeless.draft(long_match, 16) == []
    forced = Speculation("on")
    forced._kept = dict.fromkeys(forced._kept, 0.0)
    assert forced.draft(long_match, 16) == [37]
    assert Speculation("off").draft(long_match, 16) == []


def _decode_a_quote(spec: Speculation, passage: list[int]) -> int | None:
    """Greedy decoding of a reply that quotes `passage` (after a first copy of it) and then says 8, drafts
    verified against it: how far the quote had gone when the first draft was made."""
    start, reply = len(passage) + 1, [*passage, 8]
    tokens, first = [*passage, 7, *passage[:2]], None
    while len(tokens) < start + len(reply):
        pos = len(tokens) - start
        draft = spec.draft(tokens, 16)
        kept = next((j for j, tok in enumerate(draft) if tok != reply[pos + j]), len(draft))
        if draft:
            first = pos if first is None else first
            spec.record_draft(kept + 1, len(draft))
        tokens += reply[pos:pos + kept + 1]
        spec.learn(tokens)  # as the engine does once the step is under way
    return first


def test_auto_learns_from_the_drafts_it_does_not_make():
    passage = list(range(100, 180))
    spec = Speculation("auto")
    spec.cost.jump, spec.cost.slope = 0.34, 0.47  # the 2-core VM's batch costs: a draft pays only if it is sure
    spec._kept = dict.fromkeys(spec._kept, 0.0)  # and nothing has held so far
    first = _decode_a_quote(spec, passage)
    # the lookup drafts it did not make were counted as the reply showed them holding: once the quote has
    # held for some tokens (not 32, the last class, nor after a probe), auto drafts, and every draft holds
    assert first is not None and first < 16 and spec.accepted > 40 and spec.acceptance > 0.9
    cpu = Speculation("auto")
    cpu.cost.jump, cpu.cost.slope = 0.34, 0.47
    reply = [*passage, 7, *passage[:5]]
    assert cpu.draft(reply, 16) == []  # 5 tokens of agreement: not sure enough to pay here
    prior = cpu.acceptance_of(4)
    reply.append(5)  # the reply parts from the passage where the draft was not made
    cpu.learn(reply)
    assert cpu.acceptance_of(4) < prior and cpu.drafted == 0
    missed = cpu.acceptance_of(4)
    other = [*passage, 7, *passage[:5]]
    cpu.draft(other, 16)
    parted = [*other, 5]  # a new reply (its prefill makes a new list): the draft not made is not counted
    cpu.draft(parted, 16)
    cpu.learn(parted)
    assert cpu.acceptance_of(4) == missed


def test_what_a_draft_teaches():
    spec = Speculation("auto")
    spec.record_step(0.010, 1, 0)  # a plain step: one token in 10 ms, its handing out included
    spec._match = 6  # drafted where 6 tokens agreed
    before = spec.acceptance_of(4)
    spec.record_draft(4, 8)  # 3 of 8 kept (at 6, 7 and 8 tokens of agreement), the 4th missed (at 9)
    assert spec.drafted == 8 and spec.accepted == 3 and spec.acceptance == 3 / 8
    assert spec.acceptance_of(4) > before and spec.acceptance_of(8) < PRIOR[8]
    # class 8: the token at 8 kept, then the one at 9 missed; earlier counts decay at each
    assert abs(spec._kept[8] - (PRIOR[8] * 2 * 0.95 + 1) * 0.95) < 1e-9
    assert abs(spec._missed[8] - ((1 - PRIOR[8]) * 2 * 0.95 * 0.95 + 1)) < 1e-9
    # verifications costing 1.2 steps + 0.3 a draft token, 0.6 more where the step before was of another
    # size (llama.cpp builds its graph again), and the two one-token steps after them 0.3 and 0.1 more
    for _ in range(5):
        for k in (1, 2, 4, 7):
            spec.record_step(0.010 * (1.2 + 0.3 * k + 0.6), 1 + k, k)
            for _ in range(3):
                spec.record_step(0.010 * (1.2 + 0.3 * k), 1 + k, k)
            spec.record_step(0.010 * 1.3, 1, 0)
            spec.record_step(0.010 * 1.1, 1, 0)
    cost = spec.cost
    # the batch alone, against the prior's 1.33 + 0.47 k (it keeps a weight of its own: one odd measurement
    # must not make the fit) and the reshape above the prior's 0.1 (measured against the fit)
    assert all(abs(cost.jump + cost.slope * k - (0.2 + 0.3 * k)) < 0.3 * (0.13 + 0.17 * k) for k in range(1, 8))
    assert 0.25 < cost.reshape < 0.7 and abs(cost.switch - 0.4) < 0.02
    assert cost.step_s == 0.010  # the steps that rebuilt llama.cpp's graph are not plain steps
    # starting to verify costs the reshape and the switch back (less where the draft is likely to hold and
    # be followed by another); going on from a verification of the same size costs neither
    assert cost.steps(4, held=0.5) == 1 + cost.jump + cost.slope * 4 + cost.reshape + 0.5 * cost.switch
    spec.record_step(0.010 * 2.4, 5, 4)
    assert cost.batching and cost.steps(4) == 1 + cost.jump + cost.slope * 4
    assert cost.steps(2) == 1 + cost.jump + cost.slope * 2 + cost.reshape
    batch = cost.jump + cost.slope * 4
    spec.record_step(0.5, 5, 4)  # a pause elsewhere (50 steps) counts as a batch of twice the cost at most
    assert cost.jump + cost.slope * 4 < batch + 1


def test_a_greedy_chain_draws_the_logits_first_maximum(demo_engine):
    e = demo_engine
    assert is_greedy(e.make_sampler(SamplingConfig(temperature=0)))
    assert not is_greedy(e.make_sampler(SamplingConfig(temperature=0, repeat_penalty=1.1)))
    assert not is_greedy(e.make_sampler(SamplingConfig(temperature=0.7)))
    chain = e.make_sampler(SamplingConfig(temperature=0))
    draw = drawer(chain, e.ctx, e.vocab)
    e.clear()
    e.prefill(e.tokenize(NOTE, special=False))
    e._decode(e.tokenize(" The committee met on Monday", special=False), e.n_kv, want_logits=True, all_logits=True)
    for i in (0, 1, 2, 3, -1):
        assert draw(i) == lc.llama_sampler_sample(chain, e.ctx, i)
    e.clear()


@pytest.mark.parametrize("temperature,grammar", [(0.0, ""), (0.8, ""), (0.8, "root ::= [^\\x00]*")])
def test_the_repeat_penalty_applied_to_the_recent_tokens_draws_as_llama_cpps_sampler(demo_engine, temperature,
                                                                                      grammar):
    """The penalty on the few recent tokens' logits (not a lookup per candidate) gives llama.cpp's tokens, draw
    after draw as its window moves, at temperature 0 and sampling alike, and under a grammar that takes them
    (a tool step's draw); the logits are left as they were."""
    e = demo_engine
    s = SamplingConfig(temperature=temperature, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.5,
                       repeat_last_n=8, seed=7)
    ours, reference = e.make_sampler(s, grammar), _chain(s, e.vocab, e.n_ctx)  # llama.cpp's, its penalty first
    draw = drawer(ours, e.ctx, e.vocab)
    e.clear()
    prompt = e.tokenize(NOTE, special=False)
    e.prefill(prompt)
    e._decode(e.tokenize(" The committee met on Monday", special=False), e.n_kv, want_logits=True, all_logits=True)
    prime(ours, s, prompt)
    prime(reference, s, prompt)
    n_vocab = lc.llama_vocab_n_tokens(e.vocab)
    before = [logits(e.ctx, i, n_vocab).copy() for i in range(5)]
    drawn = [draw(i % 5) for i in range(40)]
    assert drawn == [lc.llama_sampler_sample(reference, e.ctx, i % 5) for i in range(40)]
    assert all(np.array_equal(logits(e.ctx, i, n_vocab), was) for i, was in enumerate(before))
    assert len(set(drawn)) > 1  # the penalty moved the draw off the same few tokens
    e.clear()


def test_sliding_window_models_draft_only_with_the_full_cache(gemma_engine, gemma_path):
    assert _chat(gemma_engine, "on").speculation is None
    full = make_engine(gemma_path, n_ctx=1024, swa_full=True)
    try:
        assert _chat(full, "on").speculation is not None
    finally:
        full.close()


def test_stats_json_counts_drafts_and_the_flag_turns_them_off(home, tmp_path, demo_path):
    stats_on, stats_off = tmp_path / "on.jsonl", tmp_path / "off.jsonl"
    lines = QUESTIONS[0] + "\n" + QUESTIONS[1] + "\n"
    # fixed threads: past 256 tokens llama.cpp's arithmetic follows their number (docs/profiles.md: Profiles)
    common = ["--model", str(demo_path), "--no-session", "--temperature", "0", "--max-tokens", "48", "--threads", "2"]
    on = run_cli([*common, "--speculate", "on", "--stats-json", str(stats_on)], lines, {"LOCALCHAT_HOME": str(home)})
    off = run_cli([*common, "--speculate", "off", "--stats-json", str(stats_off)], lines,
                  {"LOCALCHAT_HOME": str(home)})
    assert on.returncode == off.returncode == 0, on.stderr + off.stderr
    assert on.stdout == off.stdout
    rows_on = [json.loads(x) for x in stats_on.read_text().splitlines()]
    rows_off = [json.loads(x) for x in stats_off.read_text().splitlines()]
    assert all(r["accepted_tokens"] <= r["draft_tokens"] for r in rows_on)
    assert sum(r["accepted_tokens"] for r in rows_on) > 0 and "% accepted" in on.stderr
    assert all("draft_tokens" not in r for r in rows_off)


def test_a_draft_model_keeps_greedy_replies_identical_across_turns_undo_and_resume(home, tmp_path, demo_path):
    """The demo model's first 15 layers draft for it (real weights, the same vocabulary, drafts often
    rejected): the replies are those without drafts, token for token."""
    draft = first_layers(demo_path, tmp_path / "draft.gguf", 15)
    lines = "\n".join([QUESTIONS[0], QUESTIONS[1], "/undo", "Name three rivers."]) + "\n"
    # under 256 tokens of context: past that llama.cpp's CPU kernels for a batch and for one token part (docs/profiles.md: Speed)
    common = ["--model", str(demo_path), "--temperature", "0", "--max-tokens", "24", "--threads", "2"]
    out = {}
    for name, extra in (("plain", ["--speculate", "off"]), ("draft", ["--speculate", "on", "--draft-model", str(draft)])):
        stats = tmp_path / f"{name}.jsonl"
        first = run_cli([*common, *extra, "--session", name, "--stats-json", str(stats)], lines,
                        {"LOCALCHAT_HOME": str(home)})
        resumed = run_cli([*common, *extra, "--session", name, "--stats-json", str(stats)], "And two lakes?\n",
                          {"LOCALCHAT_HOME": str(home)})
        assert first.returncode == resumed.returncode == 0, first.stderr + resumed.stderr
        out[name] = (first.stdout + resumed.stdout, [json.loads(x) for x in stats.read_text().splitlines()])
    assert out["draft"][0] == out["plain"][0]
    rows = out["draft"][1]
    assert sum(r["draft_model_tokens"] for r in rows) > 0 and sum(r["accepted_tokens"] for r in rows) > 0
    assert rows[-1]["kv_restored"] is True and max(r["ctx_used"] for r in rows) <= 256
    # after the resume the draft model's KV was empty: it evaluated the restored context once, counted
    assert rows[-1]["draft_model_evaluated"] >= rows[-1]["prompt_tokens"] - rows[-1]["new_tokens"]


def test_a_draft_model_of_another_vocabulary_is_refused(home, demo_path, gemma_path):
    r = run_cli(["--model", str(demo_path), "--draft-model", "gemma-270m", "--no-session"], "Hi\n",
                {"LOCALCHAT_HOME": str(home)})
    assert r.returncode == 2
    assert "has another vocabulary" in r.stderr and "must share the model's tokenizer" in r.stderr


def test_a_draft_model_that_does_not_fit_beside_the_plan_is_refused_before_it_loads(demo_engine, demo_path):
    from dataclasses import replace

    import pytest

    from localchat.errors import ProfileError
    from localchat.machine import models, plan
    from localchat.machine.profiles import Profile
    from localchat.runtime import open_draft
    info = models.model_info(demo_path)
    card = Profile(name="tiny-card", source="tiny-card.yaml", vram_gb=1.3, n_gpu_layers=-1, n_ctx=8192,
                   model=str(demo_path))
    laid = plan.make_plan(card, info, free=0)
    assert laid.gpu and laid.total_gpu_bytes < laid.budget_bytes  # the model alone fits the card
    with pytest.raises(ProfileError) as exc:
        open_draft(replace(card, draft_model=str(demo_path)), laid, demo_engine, lambda t: None)
    assert "the draft model" in str(exc.value) and "lower n_ctx or drop draft_model" in str(exc.value)
    shown = run_cli(["plan", "--model", str(demo_path), "--draft-model", str(demo_path)])
    assert shown.returncode == 0 and "draft      " in shown.stdout and "in RAM beside the model" in shown.stdout


def test_a_slow_first_step_does_not_make_drafts_look_cheap():
    cost = StepCost(gpu=True)
    cost.record(0.0058, 0)  # the first reply's first plain step, slowed by something else
    for _ in range(6):
        cost.record(0.0022, 0)  # what a step costs
    assert cost.step_s < 0.0023
    cost.record(0.0500, 0)  # one pause moves it a little
    assert cost.step_s < 0.0075


def test_a_sampled_chat_drafts_a_quote_once_it_holds_not_on_a_chance_match():
    quote = list(range(1, 41))
    chance = quote + [99] + quote[:20]  # 20 tokens agree: a greedy chat drafts on its priors
    greedy, sampled, quoting = Speculation("auto"), Speculation("auto", sampled=True), Speculation("auto", sampled=True)
    for spec in (greedy, sampled, quoting):
        spec.cost.jump, spec.cost.slope, spec.cost.reshape, spec.cost.switch = 0.2, 0.17, 0.6, 1.0  # an H100's
    assert len(greedy.draft(chance, 16)) > 0 and sampled.draft(chance, 16) == []
    passage = list(range(100, 180))
    first = _decode_a_quote(quoting, passage)  # the lookups not made teach it the quote holds
    assert first is not None and first < 16 and quoting.acceptance > 0.85
