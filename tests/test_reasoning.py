"""A reasoning model's thoughts: told apart from the answer as they stream, counted, kept in the
transcript (marked), cut at a budget, switched off where the template can, hidden or shown; on the
real demo model with official reasoning templates (the thoughts forced through the reply tokens
where the model writes none, or sampled for real behind a prompt that opens them)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from localchat.chat import transcript
from localchat.chat.request import TurnSink
from localchat.chatformat import thinking
from tests.conftest import run_cli
from tests.ggufedit import edit_gguf
from tests.test_official import chat_with, forced_reply, kv_text
from tests.test_repl import Harness

CASES = {  # template: a reply with thoughts in its format
    "Qwen-Qwen3-0.6B.jinja": "<think>\nPlan the answer first.\n</think>\n\nFour.",
    "openai-gpt-oss-120b.jinja": "<|channel|>analysis<|message|>Plan the answer first.<|end|><|start|>assistant"
                                 "<|channel|>final<|message|>Four.",
    "google-gemma-4-31B-it.jinja": "<|channel>thought\nPlan the answer first.<channel|>Four.",
}
R1 = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"  # its generation prompt opens the thoughts


@pytest.fixture(scope="module")
def r1_model(demo_path, tmp_path_factory):
    from tests.official_templates import templates_dir
    return edit_gguf(demo_path, tmp_path_factory.mktemp("r1") / "r1-demo.gguf",
                     {"tokenizer.chat_template": (templates_dir() / R1).read_text()})


@pytest.mark.parametrize("name", list(CASES))
def test_thoughts_stream_apart_from_the_answer_and_are_kept_marked(demo_engine, official_dir, name):
    chat = chat_with(demo_engine, (official_dir / name).read_text(), None)
    shown, thoughts = [], []
    with forced_reply(demo_engine, CASES[name]):
        st = chat.turn("What is 2 + 2?", TurnSink(text=shown.append, thought=thoughts.append))
    assert "".join(shown).strip() == "Four." and "".join(thoughts).strip() == "Plan the answer first."
    reply = chat.conv.messages[-1]
    assert reply.content == "Four." and reply.reasoning == "Plan the answer first."
    assert transcript.message(reply)["reasoning"] == "Plan the answer first."
    # the thoughts' tokens, some of their markers (text here, one token each in the real vocabularies) at most
    at_least = len(demo_engine.tokenize("Plan the answer first.", special=False))
    at_most = len(demo_engine.tokenize(CASES[name].split("Four.")[0], special=True))
    assert at_least <= st.decode.reasoning_tokens <= at_most


def test_a_budget_ends_the_thoughts_and_the_model_answers(demo_engine, official_dir):
    source = (official_dir / R1).read_text()
    free = chat_with(demo_engine, source, None)  # the prompt opens the thoughts; the demo model never closes them
    st = free.turn("What is 2 + 2?")
    assert st.decode.reasoning_tokens == st.reply_tokens and not free.conv.messages[-1].content
    budgeted = chat_with(demo_engine, source, None)
    budgeted.settings = dataclasses.replace(budgeted.settings, reasoning_budget=4, max_tokens=16)
    st = budgeted.turn("What is 2 + 2?")
    reply = budgeted.conv.messages[-1]
    forced = len(demo_engine.tokenize(thinking.END_OF_THOUGHT["think"], special=True))
    assert st.decode.reasoning_tokens == 4 + forced  # the budget, then the end of thought the model was made to write
    assert "</think>" in kv_text(demo_engine, reply.tokens)
    assert reply.reasoning and reply.content and st.reply_tokens > st.decode.reasoning_tokens


def test_thinking_switches_off_where_the_template_can(demo_engine, official_dir):
    chat = chat_with(demo_engine, (official_dir / "Qwen-Qwen3-0.6B.jinja").read_text(), None)
    assert chat.fmt.thinking_switch == "enable_thinking"
    assert chat.fmt.set_thinking("off") == "thinking: False"
    assert chat.fmt.first_turn(None, "Hi").after.endswith("<think>\n\n</think>\n\n")  # an empty thought, as Qwen3 does
    oss = chat_with(demo_engine, (official_dir / "openai-gpt-oss-120b.jinja").read_text(), None)
    assert oss.fmt.set_thinking("high") == "thinking: high"
    assert "Reasoning: high" in oss.fmt.first_turn(None, "Hi").before
    plain = chat_with(demo_engine, (official_dir / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(), None)
    assert "no thinking switch" in plain.fmt.set_thinking("off")


def test_line_mode_prints_the_answer_and_the_thoughts_only_when_asked(home, r1_model):
    args = ["--model", str(r1_model), "--temperature", "0", "--max-tokens", "16", "--reasoning-budget", "4",
            "--session", "think"]
    hidden = run_cli(args, "What is 2 + 2?\n", {"LOCALCHAT_HOME": str(home)})
    assert hidden.returncode == 0, hidden.stderr
    records = [json.loads(x) for x in (home / "sessions" / "think" / "transcript.jsonl").read_text().splitlines()]
    reply = [r for r in records if r.get("t") == "msg" and r["role"] == "assistant"][-1]
    assert reply["reasoning"] and reply["content"]
    assert hidden.stdout.strip() == reply["content"] and reply["reasoning"] not in hidden.stderr
    shown = run_cli([*args[:-1], "think2", "--show-reasoning"], "What is 2 + 2?\n", {"LOCALCHAT_HOME": str(home)})
    assert shown.stdout.strip() == reply["content"]  # the same reply (temperature 0), its thoughts apart:
    assert f"{reply['reasoning']}\n[turn 1]" in shown.stderr
    assert re.search(r"thought \d+ of \d+ tokens", hidden.stderr)  # the summary counts thoughts apart
    exported = run_cli(["sessions", "export", "think"], env={"LOCALCHAT_HOME": str(home)}).stdout
    assert "> *reasoning:*" in exported and reply["content"] in exported


def test_the_terminal_ui_folds_the_thoughts_and_shows_them_on_request(home, r1_model):
    h = Harness(home, max_tokens=16, session="fold", model=str(r1_model), reasoning_budget=4)
    printed: list[str] = []
    h.repl.print_fragments = lambda fragments: printed.append("".join(t for _, t, *_ in fragments))
    h.repl.view.markdown = False  # the answer as the model wrote it, to compare
    try:
        st = h.say("What is 2 + 2?")
        reply = h.ctl.chat.conv.messages[-1]
        assert st["reasoning_tokens"] >= 4 and printed[0].startswith("[thought for ")
        assert reply.reasoning not in printed[0] and reply.content in printed[-1]
        assert "thoughts shown" in h.command("/think show")
        h.say("And 3 + 3?")
        assert h.ctl.chat.conv.messages[-1].reasoning.strip() in "\n".join(printed[-2:])
    finally:
        h.close()
