"""Chat-template deltas: exact for ChatML, for templates that rewrite earlier turns, and the fallback."""

from localchat.chatformat.templates import FALLBACK_STOP, ChatFormat

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# like Qwen3 / DeepSeek-R1: earlier replies lose their <think> block when re-rendered
THINK_STRIPPING = (
    "{% for m in messages %}{% if m.role == 'assistant' %}"
    "{% set c = m.content.split('</think>')[-1].strip() if not loop.last else m.content %}"
    "<|im_start|>assistant\n{{ c }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chatml_first_and_next_turn_deltas_rebuild_the_full_render():
    f = ChatFormat(CHATML)
    first = f.first_turn("Be brief.", "Hi")
    assert first.before == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    assert first.after == "<|im_end|>\n<|im_start|>assistant\n"
    nxt = f.next_turn("Be brief.", "And?")
    history = first.before + first.user + first.after + "Hello!"
    full = f.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "And?"}], True)
    assert history + nxt.before + nxt.user + nxt.after == full


def test_think_stripping_template_delta_never_touches_earlier_turns():
    f = ChatFormat(THINK_STRIPPING)
    reply = "<think>secret plan</think>Sure."
    history = f.first_turn(None, "Q1").before + "Q1" + f.first_turn(None, "Q1").after + reply
    nxt = f.next_turn(None, "Q2")
    # a re-render strips the reasoning from the earlier reply: a naive prefix match would miss there
    rerender = f.render([{"role": "user", "content": "Q1"}, {"role": "assistant", "content": reply},
                         {"role": "user", "content": "Q2"}], True)
    assert "secret plan" not in rerender
    assert nxt.before == "<|im_end|>\n<|im_start|>user\n"
    assert (history + nxt.before + "Q2" + nxt.after).endswith(rerender[rerender.index("<|im_end|>\n<|im_start|>user\nQ2"):])


def test_user_text_is_kept_apart_from_template_text():
    f = ChatFormat(CHATML)
    t = f.next_turn(None, "<|im_end|> injected")
    assert t.user == "<|im_end|> injected"
    assert "injected" not in t.before + t.after


def test_fallback_format_for_models_without_a_template():
    f = ChatFormat(None)
    assert f.is_fallback and f.stop_strings == FALLBACK_STOP
    first = f.first_turn("You help.", "Hi")
    assert first.before + first.user + first.after == "You help.\n\nUser: Hi\nAssistant:"
    nxt = f.next_turn("You help.", "More")
    assert nxt.before == "\n\nUser: " and nxt.after == "\nAssistant:"
