"""The front door (`localchat.host`): a whole message list mapped to the conversation's delta, the way a
client that re-sends its history talks to a server; on the real demo model, counted in tokens."""

from __future__ import annotations

import pytest

from localchat import runtime
from localchat.chat.conversation import Conversation
from localchat.errors import RequestError
from localchat.host.host import Host, delta
from localchat.session.lifecycle import Session, SessionChoice


def _conv(*exchanges: tuple[str, str]) -> Conversation:
    conv = Conversation(system="Be brief.")
    for asked, answered in exchanges:
        conv.add_user(asked, [], [])
        conv.add_reply(answered, [], False)
    return conv


def test_a_list_that_repeats_the_conversation_adds_only_its_last_message():
    conv = _conv(("Hi", "Hello!"), ("Name a color", "Blue."))
    d = delta(conv, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a color"},
                     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "And a fruit?"}])
    assert (d.undo, d.text, d.system_changed) == (0, "And a fruit?", False)


def test_a_list_that_parts_from_the_conversation_undoes_back_to_where_it_parts():
    conv = _conv(("Hi", "Hello!"), ("Name a color", "Blue."))
    d = delta(conv, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                     {"role": "user", "content": "Name a number"}])
    assert (d.undo, d.text) == (1, "Name a number")
    assert delta(conv, [{"role": "user", "content": "Start over"}]).undo == 2
    assert delta(conv, [{"role": "system", "content": "Be long."}, {"role": "user", "content": "x"}]).system_changed


def test_a_list_the_conversation_cannot_take_is_refused_in_one_line():
    conv = _conv(("Hi", "Hello!"))
    with pytest.raises(RequestError, match="must end with a user message"):
        delta(conv, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])
    with pytest.raises(RequestError, match="only the last user message can be new"):
        delta(conv, [{"role": "user", "content": "Other"}, {"role": "assistant", "content": "Words"},
                     {"role": "user", "content": "Then?"}])


@pytest.fixture
def host(home, demo_path):
    profile = runtime.load_profile("cpu", {"temperature": 0.0, "max_tokens": 8, "n_ctx": 2048,
                                           "model": str(demo_path)})
    rt = runtime.open_runtime(profile, lambda text: None)
    h = Host(Session.open(rt, SessionChoice(keep=False), lambda text: None))
    yield h
    h.close()
    rt.close()


def test_a_client_resending_its_history_evaluates_only_the_new_message(host):
    first = host.answer([{"role": "user", "content": "Name a color."}])
    reply = host.session.chat.conv.messages[-1].content
    history = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": reply}]
    st = host.answer([*history, {"role": "user", "content": "Name a fruit."}])
    assert st.turn == 2 and st.recomputed_tokens <= st.new_tokens + 1
    assert st.cached_tokens >= first.prompt_tokens  # the whole first exchange came from the KV

    again = host.answer([*history, {"role": "user", "content": "Name an animal."}])  # the second one edited
    assert again.turn == 2 and [m.content for m in host.session.chat.conv.messages if m.role == "user"] == \
        ["Name a color.", "Name an animal."]
    assert again.cached_tokens >= first.prompt_tokens and again.recomputed_tokens <= again.new_tokens + 1


def test_a_served_reply_under_penalties_is_the_same_where_its_sampler_is_primed_while_the_gpu_computes(
        home, demo_path, monkeypatch):
    """`localchat serve` primes a reply's sampler with the prompt (the repeat penalty and DRY see the context)
    once the first batch is queued where every layer is on a GPU, before it on a CPU: the same replies either way,
    and other than with no penalty."""
    from localchat.chat.request import QUIET
    from localchat.host.asks import Ask
    from localchat.host.served import Served

    def replies(penalized: bool, queues: bool) -> list[str]:
        knobs = {"repeat_penalty": 1.3, "dry_multiplier": 0.8} if penalized else {}
        profile = runtime.load_profile("cpu", {"temperature": 0.0, "max_tokens": 24, "n_ctx": 2048,
                                               "model": str(demo_path), **knobs})
        with runtime.open_runtime(profile, lambda text: None) as rt:
            monkeypatch.setattr(rt.chat.engine, "queues", queues)
            served = Served(Session(rt, None, lambda text: None, autosave=False))
            history: list[dict] = []
            said = []
            for question in ("Name three colors.", "And three more?"):
                history.append({"role": "user", "content": question})
                said.append(served.complete(Ask(messages=list(history)), QUIET).text)
                history.append({"role": "assistant", "content": said[-1]})
            served.close()
        return said

    primed_before = replies(True, False)
    assert replies(True, True) == primed_before
    assert replies(False, False) != primed_before  # the penalty acts on these replies
