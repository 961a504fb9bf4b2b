"""A greedy reply's draw in llama.cpp's graph (its backend sampling, on by default where a GPU computes):
the same tokens as the host's argmax, drafts and tool grammars included, and any other sampler still
drawing from the logits after it. Turned on here for the CPU, which runs the same graph."""

from __future__ import annotations

import pytest

from localchat.chat.turns import Chat, ChatSettings
from localchat.engine import SamplingConfig
from localchat.engine.sampling import GraphDraw
from localchat.runtime import chat_format
from tests.conftest import make_engine
from tests.test_speculative import QUESTIONS, _kv_consistent


@pytest.fixture(scope="module")
def engines(demo_path):
    host, graph = make_engine(demo_path), make_engine(demo_path)
    graph.graph_draw = GraphDraw(graph.ctx)
    yield host, graph
    host.close()
    graph.close()


def _turns(engine, speculate: str, temperature: float, questions: list[str]) -> tuple[list[list[int]], list]:
    engine.clear()
    chat = Chat(engine, chat_format(engine), ChatSettings(max_tokens=48, speculate=speculate,
                                                          sampling=SamplingConfig(temperature=temperature, seed=3)))
    stats = [chat.turn(q) for q in questions]
    return [m.tokens for m in chat.conv.messages], stats


@pytest.mark.parametrize("speculate", ["off", "on"])
def test_greedy_replies_drawn_in_the_graph_are_the_hosts(engines, speculate):
    host, graph = engines
    want, want_stats = _turns(host, speculate, 0.0, QUESTIONS)
    got, stats = _turns(graph, speculate, 0.0, QUESTIONS)
    assert graph.graph_draw.attached and graph.drawn_in_graph  # the draw did run in the graph
    assert got == want
    _kv_consistent(graph)
    # the same evaluations: a turn's prompt tokens and one-token steps are counted as before
    assert [(s.recomputed_tokens, s.llama_eval) for s in stats] == [(s.recomputed_tokens, s.llama_eval)
                                                                    for s in want_stats]


def test_a_sampled_reply_after_greedy_ones_draws_from_logits_its_prompt_kept(engines):
    replies, counts = [], []
    for engine in engines:
        engine.clear()
        # drafts off: `auto` drafts where this moment's measured step costs say they pay, so the two engines'
        # evaluations differed under the full suite's load (13 and 15 in CI) with the same tokens
        greedy = Chat(engine, chat_format(engine), ChatSettings(max_tokens=24, speculate="off",
                                                                sampling=SamplingConfig(temperature=0)))
        greedy.turn(QUESTIONS[1])
        # another chat on the same KV, sampling: the draw leaves the graph before its prompt is evaluated, so the
        # first token's logits are kept, not evaluated again (on an 8B on the H100 that cost a turn 33 ms)
        sampled = Chat(engine, chat_format(engine), ChatSettings(
            max_tokens=24, speculate="off", sampling=SamplingConfig(temperature=0.9, seed=11)))
        st = sampled.turn(QUESTIONS[2])
        replies.append([m.tokens for m in sampled.conv.messages])
        counts.append((st.recomputed_tokens, st.llama_prompt_eval, st.llama_eval))
    graph = engines[1]
    assert not graph.graph_draw.attached and not graph.drawn_in_graph
    assert replies[1] == replies[0]
    assert counts[1] == counts[0]  # no evaluation more than where the draw never was in the graph
    _kv_consistent(graph)
    # and greedy again: the draw goes back into the graph (a new chain: llama.cpp takes one chain once)
    want, _ = _turns(engines[0], "off", 0.0, QUESTIONS[:2])
    got, _ = _turns(graph, "off", 0.0, QUESTIONS[:2])
    assert graph.graph_draw.attached and graph.drawn_in_graph and got == want
