"""On real models: every turn evaluates only what it adds, and reuse never changes the output."""

from __future__ import annotations

import copy

from localchat.engine import Generation, SamplingConfig
from tests.conftest import greedy_chat, make_engine
from tests.test_images import last_logits
from tests.test_templates import THINK_STRIPPING

QUESTIONS = ["What is the capital of France?", "And of Germany?", "Name a river there.",
             "How long is it?", "Thanks, one more fact?", "Bye!"]


def _assert_reuse(chat, questions):
    stats = [chat.turn(q) for q in questions]
    for st in stats[1:]:
        assert st.recomputed_tokens <= st.new_tokens + 1, st
        assert st.cached_tokens + st.recomputed_tokens == st.prompt_tokens
        # llama.cpp's own counter agrees (it counts a one-token batch as decode, not prompt)
        assert st.llama_prompt_eval == (st.recomputed_tokens if st.recomputed_tokens > 1 else 0)
    # token-canonical: the KV holds exactly the transcript's tokens, replies as sampled
    e = chat.engine
    assert e.tokens == chat.conv.window_tokens()
    assert len(e.tokens) - e.n_kv <= 1  # at most the last sampled token is still pending
    return stats


def test_chatml_turns_reuse_the_kv(demo_engine):
    stats = _assert_reuse(greedy_chat(demo_engine, system="You are brief."), QUESTIONS)
    assert stats[0].recomputed_tokens == stats[0].prompt_tokens
    # without overflow: new = prompt - previous prompt - previous reply (DESIGN.md)
    for prev, st in zip(stats, stats[1:]):
        assert st.new_tokens == st.prompt_tokens - prev.prompt_tokens - prev.reply_tokens


def test_the_warm_up_at_load_on_a_gpu_leaves_the_kv_empty_and_the_replies_as_they_were(demo_engine, monkeypatch):
    """Where every layer is on a GPU the engine evaluates a batch and a step at load (CUDA loads each kernel at its
    first use, which the first turn would wait for); nothing of it stays: the first turn evaluates its whole prompt,
    the same reply."""
    e = demo_engine
    e.clear()
    cold = greedy_chat(e, system="You are brief.", max_tokens=16)
    cold.turn(QUESTIONS[0])
    e.clear()
    calls = []
    monkeypatch.setattr(e, "queues", True)  # taken for an all-GPU engine for the warm-up alone
    monkeypatch.setattr(e, "_decode", lambda *a, _d=e._decode, **k: calls.append(len(a[0])) or _d(*a, **k))
    e.warm_up()
    monkeypatch.undo()
    assert calls == [min(512, e.config.n_batch, e.n_ctx - 2), 1] and e.n_kv == 0 and e.tokens == []
    warm = greedy_chat(e, system="You are brief.", max_tokens=16)
    st = warm.turn(QUESTIONS[0])
    assert st.cached_tokens == 0 and st.recomputed_tokens == st.prompt_tokens
    assert warm.conv.messages[-1].tokens == cold.conv.messages[-1].tokens
    e.warm_up()  # on a CPU: nothing evaluated (llama.cpp's CPU kernels need no loading)
    assert warm.turn(QUESTIONS[1]).cached_tokens > 0


def test_template_that_rewrites_earlier_turns_still_reuses(demo_engine):
    _assert_reuse(greedy_chat(demo_engine, template=THINK_STRIPPING), QUESTIONS[:5])


def test_sliding_window_model_with_fallback_format_reuses(gemma_engine):
    chat = greedy_chat(gemma_engine, system="A conversation with a helpful assistant.")
    assert chat.fmt.is_fallback
    _assert_reuse(chat, QUESTIONS[:5])


def test_reuse_changes_speed_never_output(demo_engine):
    reuse = greedy_chat(demo_engine, system="You are brief.")
    replies_reuse = [reuse.conv.messages[-1].tokens for q in QUESTIONS[:4] if reuse.turn(q)]
    fresh = greedy_chat(demo_engine, system="You are brief.")
    replies_fresh = []
    for q in QUESTIONS[:4]:
        demo_engine.clear()  # forget the KV: every turn re-prefills the whole history
        st = fresh.turn(q)
        assert st.cached_tokens == 0
        replies_fresh.append(fresh.conv.messages[-1].tokens)
    assert replies_reuse == replies_fresh


def test_repetition_penalties_depend_on_the_conversation_not_on_what_was_sampled_before(demo_engine, monkeypatch):
    """With a repeat penalty and DRY on, a reply depends on the conversation only: /undo and sending
    again gives the same reply, and so does a resumed chat (its KV loaded, a sampler that saw nothing). With
    the engine taken for one whose every layer is on a GPU, where the sampler is primed with the prompt while
    its first batch computes, the same replies as primed before it."""
    penalized = SamplingConfig(temperature=0, repeat_penalty=1.3, dry_multiplier=0.8)
    e = demo_engine
    chat = greedy_chat(e, system="You are brief.", max_tokens=32, sampling=penalized)
    chat.turn(QUESTIONS[0])
    saved, saved_tokens, saved_conv = bytes(e.state_bytes()), e.tokens[:e.n_kv], copy.deepcopy(chat.conv)
    chat.turn(QUESTIONS[1])
    second = chat.conv.messages[-1].tokens
    chat.undo()
    chat.turn(QUESTIONS[1])
    assert chat.conv.messages[-1].tokens == second
    resumed = greedy_chat(e, system="You are brief.", max_tokens=32, sampling=penalized)
    assert e.load_state(saved, saved_tokens)
    resumed.adopt(saved_conv)
    st = resumed.turn(QUESTIONS[1])
    assert st.cached_tokens == len(saved_tokens)  # the KV came from the saved state
    assert resumed.conv.messages[-1].tokens == second
    plain = greedy_chat(e, system="You are brief.", max_tokens=32)
    plain.turn(QUESTIONS[0])
    plain.turn(QUESTIONS[1])
    assert [m.tokens for m in plain.conv.messages] != [m.tokens for m in resumed.conv.messages]  # the penalty acts
    monkeypatch.setattr(e, "queues", True)
    queued = greedy_chat(e, system="You are brief.", max_tokens=32, sampling=penalized)
    queued.turn(QUESTIONS[0])
    queued.turn(QUESTIONS[1])
    assert [m.tokens for m in queued.conv.messages] == [m.tokens for m in resumed.conv.messages]


def test_next_turn_head_is_evaluated_after_the_reply_and_changes_no_output(demo_engine):
    warm = greedy_chat(demo_engine, system="You are brief.")
    replies_warm = []
    idle = 0
    for q in QUESTIONS[:4]:
        st = warm.turn(q)
        replies_warm.append(warm.conv.messages[-1].tokens)
        if st.turn > 1:
            # the end-of-turn token and the user header were evaluated before this turn began
            assert st.ahead.idle_tokens == idle > 1
            assert st.recomputed_tokens == st.new_tokens + 1
            assert st.llama_prompt_eval == st.recomputed_tokens - idle  # llama.cpp's count for the turn itself
        idle = warm.ahead.warm_next_head()
        window = warm.conv.window_tokens()
        assert demo_engine.n_kv == len(window) + idle - 1 and demo_engine.tokens[:len(window)] == window
    assert warm.ahead.drop_warm()  # as a save does: the KV holds the transcript's tokens, nothing pending
    assert demo_engine.tokens == warm.conv.window_tokens() and demo_engine.n_kv == len(demo_engine.tokens)
    plain = greedy_chat(demo_engine, system="You are brief.")
    replies_plain = [plain.conv.messages[-1].tokens for q in QUESTIONS[:4] if plain.turn(q)]
    assert replies_warm == replies_plain


def test_retry_finds_the_message_in_the_kv_and_counts_it_cached(demo_engine, monkeypatch):
    """/retry drops the last reply but keeps the message's tokens in the KV: the status bar says they were cached
    (it said the message was recomputed: counted as if read ahead for this turn), and llama.cpp agrees. The prompt is
    the one the first try was sent with, token for token, its head taken from that try's plan: the template is not
    rendered again on the way to the first token (it was 11.8 ms of a /retry on an H100 machine)."""
    chat = greedy_chat(demo_engine, system="You are brief.")
    renders = []
    render = chat.fmt.render
    monkeypatch.setattr(chat.fmt, "render", lambda *a, **k: renders.append(1) or render(*a, **k))
    chat.turn(QUESTIONS[0])
    first = chat.turn(QUESTIONS[1])
    prompt = chat.conv.window_tokens()[:first.prompt_tokens]
    reply = chat.conv.messages[-1].tokens
    chat.ahead.warm_next_head()  # idle time after the reply, as in the terminal UI
    rendered = len(renders)
    assert rendered >= 2  # the official form of each turn's history, laid out from the template
    again = chat.retry()
    assert len(renders) == rendered
    assert again is not None and again.turn == first.turn == 2
    assert again.prompt_tokens == first.prompt_tokens and chat.conv.window_tokens()[:first.prompt_tokens] == prompt
    assert again.recomputed_tokens == 1  # the message's last token, evaluated again for its logits
    assert again.cached_tokens == again.prompt_tokens - 1
    assert again.ahead.idle_tokens == again.ahead.read_ahead_tokens == 0
    assert again.llama_prompt_eval == again.recomputed_tokens  # llama.cpp's own counter agrees
    assert chat.conv.messages[-1].tokens == reply  # greedy: the same reply from the same prompt
    chat.turn(QUESTIONS[2])  # its history is the one after the first try's reply (the same reply): planned then
    chat.ahead.warm_next_head()
    assert len(renders) > rendered  # a new history: its form rendered from the template again


def test_sliding_window_model_warms_a_head_that_a_save_can_take_back_out(gemma_engine):
    warm = greedy_chat(gemma_engine, system="A conversation with a helpful assistant.")
    replies = []
    for q in QUESTIONS[:3]:
        st = warm.turn(q)
        replies.append(warm.conv.messages[-1].tokens)
        if st.turn > 1:
            assert st.ahead.idle_tokens > 1 and st.recomputed_tokens <= st.new_tokens + 1
        assert warm.ahead.warm_next_head() > 1
    window = warm.conv.window_tokens()
    assert warm.ahead.drop_warm() and gemma_engine.tokens == window  # as a save of a sliding-window cache does
    plain = greedy_chat(gemma_engine, system="A conversation with a helpful assistant.")
    assert [plain.conv.messages[-1].tokens for q in QUESTIONS[:3] if plain.turn(q)] == replies


def _greedy(engine, n=24):
    gen = Generation(tokens=[])
    list(engine.generate(engine.make_sampler(SamplingConfig(temperature=0)), n, gen))
    return gen.tokens


def test_sliding_window_rewind_deeper_than_the_window_recomputes(gemma_engine):
    e = gemma_engine
    words = e.tokenize(" ".join(f"item {i} is {i * 7 % 13}." for i in range(300)), special=False, add_bos=True)
    long_prompt = words[:1500]
    e.clear()
    e.prefill(long_prompt)
    assert e.pos_min() > 0  # the sliding-window layers dropped the oldest positions
    branch = words[:100] + e.tokenize(" Now a different story begins:", special=False)
    assert not e.can_rewind_to(100)
    res = e.prefill(branch)
    assert res.rewind_refused and res.cached == 0 and res.recomputed == len(branch)
    reused = _greedy(e)
    e.clear()
    e.prefill(branch)
    assert _greedy(e) == reused


def test_swa_full_makes_deep_rewinds_exact_without_recompute(gemma_path):
    e = make_engine(gemma_path, n_ctx=1024, swa_full=True)
    try:
        words = e.tokenize(" ".join(f"item {i} is {i * 7 % 13}." for i in range(300)), special=False, add_bos=True)
        e.prefill(words[:900])
        branch = words[:100] + e.tokenize(" Now a different story begins:", special=False)
        res = e.prefill(branch)
        assert res.cached == 100 and not res.rewind_refused
        reused = _greedy(e)
        e.clear()
        e.prefill(branch)
        assert _greedy(e) == reused
    finally:
        e.close()


def test_a_short_batch_at_depth_is_padded_on_a_cpu_and_changes_nothing(demo_engine):
    """llama.cpp's CPU flash attention takes a slow path below 64 queries; the engine pads such a batch
    where that is cheaper and drops the padding from the KV at once: the same history, the same next
    tokens (llama.cpp would refuse the next position were the padding still there)."""
    import llama_cpp as lc
    import numpy as np

    from localchat.engine.sampling import logits
    e = demo_engine
    n_vocab = lc.llama_vocab_n_tokens(e.vocab)
    words = e.tokenize(" ".join(f"item {i} is {i * 7 % 13}." for i in range(400)), special=False, add_bos=True)
    history, prompt, more = words[:600], words[:640], words[640:642]
    runs = []
    for pads in (True, False):
        e._pads = pads
        try:
            e.clear()
            e.prefill(history)
            e.reset_perf()
            e.prefill(prompt)
            e.synchronize()
            perf = e.perf()
            assert e.n_kv == len(prompt) and e.tokens == prompt and perf["prompt_n"] == 40
            first = np.array(logits(e.ctx, -1, n_vocab))
            e.prefill(prompt + more)  # the next positions, where any padding left would sit
            runs.append((perf["padding_n"], first, np.array(logits(e.ctx, -1, n_vocab))))
        finally:
            e._pads = True
    (padded, *ours), (plain, *theirs) = runs
    assert padded == 24 and plain == 0  # 40 tokens at depth 600 padded to a tile of 64
    for a, b in zip(ours, theirs):  # the tile's arithmetic differs from one query's in the last bits only
        assert a.argmax() == b.argmax() and np.abs(a - b).max() < 1.5


def test_on_a_cpu_each_token_is_handed_out_before_the_next_is_evaluated(demo_engine):
    """llama_decode returns only when a CPU is done: evaluating the next token before handing this one
    out would hold every token (the first included) back by one step. A GPU computes after it returns,
    so there the next evaluation starts first."""
    from localchat.engine import SamplingConfig
    e = demo_engine
    assert not e.overlaps  # a CPU build, no offload
    prompt = e.tokenize("The sky is", special=False, add_bos=True)
    e.clear()
    e.prefill(prompt)
    held_at_text = []
    gen = Generation(tokens=[])
    for _ in e.generate(e.make_sampler(SamplingConfig(temperature=0.0)), 4, gen):
        held_at_text.append(e.n_kv - len(prompt))
    assert held_at_text == [0, 1, 2, 3]  # the token just handed out is not evaluated yet


def test_a_prompt_evaluated_ahead_with_its_logits_is_sampled_without_evaluating_anything(demo_engine):
    """Work done ahead that ends the prompt with its last token's logits (the message as if sent) leaves
    the prefill nothing to evaluate; any later evaluation, rewind or shift makes those logits stale."""
    e = demo_engine
    prompt = e.tokenize("Why is the sea blue?", special=False, add_bos=True)
    e.clear()
    e.advance(prompt[:-3], 64)
    e.advance(prompt, 64, logits=True)
    assert e.n_kv == e.logits_end == len(prompt)
    assert e.prefill(prompt).recomputed == 0
    e.truncate(len(prompt) - 1)
    e.advance(prompt, 64)  # no logits asked: the last token's are not kept
    assert e.logits_end == -1 and e.prefill(prompt).recomputed == 1


def test_a_parked_sequence_comes_back_exact_and_gives_its_cells_when_asked(demo_path, gemma_path):
    """A conversation parked in a second llama.cpp sequence while another is evaluated comes back with the same
    tokens and the same next-token logits; when the context runs out of cells the engine asks for room, and a
    model with a sliding window keeps one sequence."""
    import numpy as np

    e = make_engine(demo_path, n_ctx=512, sequences=4)
    try:
        a = e.tokenize("The capital of France is Paris. The capital of Italy is", False, False)
        b = e.tokenize("Once upon a time there was a dragon who", False, False)
        e.prefill(a)
        before = last_logits(e)
        assert e.park(1)
        e.prefill(b)
        assert e.unpark(1, a) and e.tokens == a and e.n_kv == len(a)
        e.prefill(a)  # the last token evaluated again for its logits: nothing else
        assert np.allclose(last_logits(e), before, atol=1e-4)
        words = e.tokenize("word " * 400, False, False)[:300]
        e.clear()
        e.prefill(words)
        assert e.park(2)
        asked: list[int] = []

        def make_room() -> bool:
            if asked:
                return False
            asked.append(1)
            e.drop(2)
            return True
        e.when_full(make_room)
        e.clear()
        e.prefill(e.tokenize("hello " * 400, False, False)[:300])  # 600 cells in 512: room made by the drop
        assert asked == [1] and e.n_kv == 300
    finally:
        e.close()
    g = make_engine(gemma_path, n_ctx=1024, sequences=4)
    try:
        assert g.sequences == 1 and not g.park(1)
    finally:
        g.close()

