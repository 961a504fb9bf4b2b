"""The prompt is always the one the model was trained on.

Official templates of 24 current families (tests/official_templates.py names each one's source),
swapped onto the real demo model's weights: 4-turn chats with and without a system prompt, the
reasoning forced through the reply tokens for reasoning templates (the demo model writes none).
Before each reply, the KV's text is compared with the template's own rendering of the conversation
(Hugging Face style); the history reaches that form between turns, counted apart from the turn.
"""

from __future__ import annotations

import contextlib
import json

import pytest

from localchat.bench.idle import forced_reply as forced
from localchat.chat.conversation import Conversation
from localchat.chat.official import template_messages
from localchat.chat.turns import Chat, ChatSettings
from localchat.chatformat import reasoning
from localchat.chatformat.templates import ChatFormat
from localchat.engine import SamplingConfig
from tests.conftest import run_cli
from tests.ggufedit import edit_gguf
from tests.official_templates import TEMPLATES

QUESTIONS = ["What is bread?", "Name a colour.", "And a second one?", "Thanks, bye."]
SYSTEM = "You are a concise assistant."
SCRIPTS = {  # replies with thoughts, in each reasoning format
    "think": "<think>\nThe user asks question {i}. A short answer will do.\n</think>\n\nAnswer number {i}.",
    "harmony": "<|channel|>analysis<|message|>Question {i} needs a short answer.<|end|>"
               "<|start|>assistant<|channel|>final<|message|>Answer number {i}.",
    "gemma4": "<|channel>thought\nQuestion {i} needs a short answer.<channel|>Answer number {i}.",
}


def forced_reply(engine, text: str | None, *more: str):
    """The next reply is `text` and the end-of-turn token (the bench's forcing), the replies after it `more`,
    or what greedy sampling gives."""
    if text is None:
        return contextlib.nullcontext()
    eog = next(t for t in range(64) if engine.is_eog(t))
    return forced(engine, *(engine.tokenize(t, special=True) + [eog] for t in (text, *more)))


def kv_text(engine, tokens) -> str:
    return b"".join(engine.piece(t, special=True) for t in tokens).decode("utf-8", "replace")


def chat_with(engine, source: str, system: str | None, history: str = "official") -> Chat:
    engine.clear()
    fmt = ChatFormat(source, engine.special_text("bos"), engine.special_text("eos"))
    return Chat(engine, fmt, ChatSettings(system=system, max_tokens=8, history=history,
                                                 sampling=SamplingConfig(temperature=0)))


def official_prompt(chat: Chat, question: str) -> str:
    """The template's rendering of the conversation before the last reply, its last message `question`."""
    history = [m for m in chat.conv.messages if m.in_window][:-2]
    messages = template_messages(chat.fmt, chat.engine, history) + [{"role": "user", "content": question}]
    return chat.fmt.render(chat.fmt.with_system(chat.conv.system, messages), True)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_every_prompt_is_the_official_rendering(demo_engine, official_dir, name):
    source = (official_dir / name).read_text()
    style = reasoning.detect(source)
    for system in (None, SYSTEM):
        chat = chat_with(demo_engine, source, system)
        for i, question in enumerate(QUESTIONS):
            with forced_reply(demo_engine, SCRIPTS[style].format(i=i) if style else None):
                st = chat.turn(question)
            prompt = chat.conv.window_tokens()[:st.prompt_tokens]
            assert kv_text(demo_engine, prompt) == official_prompt(chat, question), (name, system, st.turn)
            if st.turn > 1:  # reuse stays exact inside the turn; the official form's work is counted apart
                assert st.recomputed_tokens <= st.new_tokens + 1, (name, system, st)
            chat.ahead.warm_next_head()
        if style and "A short answer will do" not in official_prompt(chat, question):
            # the template drops earlier thoughts: they left the KV between turns, and that work was counted
            assert sum(h.ahead.canonicalized_tokens for h in chat.turn_stats) > 0


def test_as_sampled_history_keeps_the_thoughts_the_template_drops(demo_engine, official_dir):
    source = (official_dir / "Qwen-Qwen3-0.6B.jinja").read_text()
    prompts, reference = {}, ""
    for mode in ("official", "as-sampled"):
        chat = chat_with(demo_engine, source, None, history=mode)
        for i, question in enumerate(QUESTIONS[:2]):
            with forced_reply(demo_engine, SCRIPTS["think"].format(i=i)):
                st = chat.turn(question)
            chat.ahead.warm_next_head()
        prompts[mode] = kv_text(demo_engine, chat.conv.window_tokens()[:st.prompt_tokens])
        reference = official_prompt(chat, QUESTIONS[1])
    assert prompts["official"] == reference and "The user asks question 0" not in reference
    assert "The user asks question 0" in prompts["as-sampled"]  # what the official form is for


def test_the_system_prompt_moves_to_the_last_message_and_is_never_repeated(demo_engine, official_dir):
    chat = chat_with(demo_engine, (official_dir / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text(), SYSTEM)
    for question in QUESTIONS:
        chat.turn(question)
        assert kv_text(demo_engine, chat.conv.window_tokens()).count(SYSTEM) == 1
        chat.ahead.warm_next_head()
    assert all(h.ahead.canonicalized_tokens > 0 for h in chat.turn_stats[1:])


def test_a_template_without_a_system_role_gets_it_in_the_first_message(demo_engine, official_dir):
    chat = chat_with(demo_engine, (official_dir / "google-gemma-2-2b-it.jinja").read_text(), SYSTEM)
    assert not chat.fmt.system_role
    chat.turn(QUESTIONS[0])
    text = kv_text(demo_engine, chat.conv.window_tokens())
    assert text.index(SYSTEM) < text.index(QUESTIONS[0]) and text.count(SYSTEM) == 1


def test_a_session_keeps_the_date_it_started_on(demo_engine, official_dir):
    chat = chat_with(demo_engine, (official_dir / "meta-llama-Llama-3.2-3B-Instruct.jinja").read_text(), None)
    chat.adopt(Conversation(started="2025-01-15T09:30:00"))
    chat.turn(QUESTIONS[0])
    assert "Today Date: 15 Jan 2025" in kv_text(demo_engine, chat.conv.window_tokens())


def test_line_mode_with_a_moving_system_prompt_counts_the_official_work(home, demo_path, official_dir, tmp_path):
    model = edit_gguf(demo_path, tmp_path / "nemo.gguf", {
        "tokenizer.chat_template": (official_dir / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()})
    stats = tmp_path / "s.jsonl"
    r = run_cli(["--model", str(model), "--temperature", "0", "--max-tokens", "8", "--system", SYSTEM,
                 "--session", "nemo", "--stats-json", str(stats)], stdin="".join(q + "\n" for q in QUESTIONS),
                env={"LOCALCHAT_HOME": str(home)})
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in stats.read_text().splitlines()]
    assert len(rows) == 4 and all(row["canonicalized_tokens"] > 0 for row in rows[1:])
    assert all(row["recomputed_tokens"] <= row["new_tokens"] + 1 for row in rows[1:])
    # resumed: the official form the transcript recorded comes back, and the saved KV matches it
    r = run_cli(["--model", str(model), "--temperature", "0", "--max-tokens", "8", "--session", "nemo"],
                stdin="One more?\n", env={"LOCALCHAT_HOME": str(home)})
    assert r.returncode == 0 and "KV restored from disk" in r.stderr, r.stderr
