"""/model NAME inside a chat, on real models (the demo model and Gemma-3-270M, another vocabulary and
template): the session saved, the conversation carried over as text and laid out in the new template's
official form, evaluated once; a model that cannot be used leaves the chat on the one it had; a session
resumed with another model than the one its tokens were made with is carried over the same way."""

from __future__ import annotations

import json
import re

import pytest

from localchat import runtime
from localchat.chat import attaching, official
from localchat.errors import LocalchatError
from localchat.session import modelswitch
from localchat.session.lifecycle import Session, SessionChoice
from tests.conftest import run_cli
from tests.ggufedit import edit_gguf
from tests.test_official import kv_text

SETTINGS = {"max_tokens": 8, "temperature": 0.0, "n_ctx": 2048}


def _open(model, name: str = "switch") -> Session:
    profile = runtime.load_profile("cpu", {**SETTINGS, "model": str(model)})
    rt = runtime.open_runtime(profile, lambda text: None)
    return Session.open(rt, SessionChoice(name), lambda text: None)


@pytest.fixture(scope="module")
def gemma_it(gemma_path, official_dir, tmp_path_factory):
    """Gemma-3-270M (another vocabulary) with Gemma's chat template (its file has none)."""
    template = (official_dir / "google-gemma-2-2b-it.jinja").read_text()
    return edit_gguf(gemma_path, tmp_path_factory.mktemp("gemma") / "gemma-it.gguf",
                     {"tokenizer.chat_template": template})


def _official_and_exact(ctl: Session) -> None:
    """The KV holds the history exactly as the model's own template renders it, up to the next words."""
    e, chat = ctl.rt.engine, ctl.chat
    rendered = official.official_prefix(chat.fmt, e, chat.conv)
    assert rendered is not None and not chat.fmt.is_fallback
    bos = e.special_text("bos") if e.add_bos and not rendered.startswith(e.special_text("bos")) else ""
    docs = "".join(d.block for d in chat.docs.pending)  # attached, not sent: may be evaluated ahead after it
    assert kv_text(e, e.tokens[:e.n_kv]) in {bos + rendered, bos + rendered + docs}


def _close(ctl: Session) -> None:
    ctl.close()
    ctl.rt.close()


def test_a_switch_carries_the_conversation_over_in_the_new_templates_form(home, demo_path, gemma_it):
    ctl = _open(demo_path)
    first = ctl.rt
    try:
        ctl.turn("My name is Ana. Remember it.")
        attaching.add_text(ctl.chat, "notes", "Ana's birthday is in May.")  # attached, not sent yet
        said = modelswitch.switch_model(ctl, str(gemma_it))
        assert said.startswith("model gemma-it.gguf") and "1 turn carried over as text" in said
        assert first.engine.ctx is None and ctl.rt.model.path == gemma_it  # the old model's memory is free
        _official_and_exact(ctl)  # Gemma's own turn markers, not SmolLM2's
        doc = ctl.chat.docs.pending[0]
        assert doc.tokens == ctl.rt.engine.tokenize(doc.block, special=False)  # in Gemma's vocabulary
        st = ctl.turn("What is my name?")
        assert st.recomputed_tokens <= st.new_tokens + 1  # the switch evaluated the history once, not again
        words = [m.words for m in ctl.chat.conv.messages if m.role == "user"]
        assert words == ["My name is Ana. Remember it.", "What is my name?"]  # nothing the user typed is lost
        assert "Ana's birthday is in May." in ctl.chat.conv.messages[-2].content  # nor what was attached
    finally:
        _close(ctl)
    back = _open(demo_path)  # the session, resumed with the model it started on
    try:
        assert back.chat.conv.turns == 2
        _official_and_exact(back)
        st = back.turn("Thanks.")
        assert st.recomputed_tokens <= st.new_tokens + 1
    finally:
        _close(back)


def test_a_model_that_cannot_be_used_leaves_the_chat_on_its_own(home, demo_path, tmp_path):
    ctl = _open(demo_path, "stays")
    try:
        ctl.turn("Hello there.")
        before = ctl.rt
        with pytest.raises(LocalchatError, match="no-such-model"):
            modelswitch.switch_model(ctl, str(tmp_path / "no-such-model.gguf"))
        assert ctl.rt is before and before.engine.ctx is not None  # refused before anything was unloaded
        broken = edit_gguf(demo_path, tmp_path / "drops-messages.gguf", {"tokenizer.chat_template": "{{ 'hi' }}"})
        with pytest.raises(LocalchatError, match="drops-messages.gguf"):
            modelswitch.switch_model(ctl, str(broken))  # refused by the load, after the unload
        assert ctl.rt.model.path == demo_path and ctl.rt.engine.ctx is not None  # reloaded
        _official_and_exact(ctl)
        st = ctl.turn("Still there?")
        assert st.recomputed_tokens <= st.new_tokens + 1 and ctl.chat.conv.turns == 2
    finally:
        _close(ctl)


def test_model_in_line_mode_lists_switches_and_the_status_names_the_model(home, demo_path, gemma_path):
    from localchat.machine.fetch import EMBEDDING_ALIAS, ensure_builtin
    ensure_builtin(EMBEDDING_ALIAS, lambda text: None)  # in the models' cache: listed, marked as no chat
    r = run_cli(["--model", str(demo_path), "--max-tokens", "8", "--temperature", "0", "--session", "cli"],
                stdin="My name is Ana.\n/model\n/model gemma-270m\nWhat is my name?\n")
    assert r.returncode == 0, r.stderr
    assert "* SmolLM2-135M-Instruct" in r.stderr and "gemma-3-270m" in r.stderr  # /model alone: the list
    assert re.search(r"all-MiniLM-L6-v2\.F16 +cache +\(embeddings: for search by meaning, not a chat\)", r.stderr)
    assert "model gemma-3-270m-q4_k_m.gguf: 1 turn carried over as text" in r.stderr
    assert r.stderr.count("[turn ") == 2
    kept = json.loads((home / "sessions" / "cli" / "meta.json").read_text())["options"]["given"]
    assert kept["model"].endswith("gemma-3-270m-q4_k_m.gguf") and kept["mmproj"] == "auto"  # `-c` goes on with it
    assert kept["draft_model"] == ""  # a draft is made for one vocabulary: none, as /model chose
    r = run_cli(["-c"], stdin="Thanks.\n")
    assert r.returncode == 0 and "KV restored from disk" in r.stderr and "gemma-3-270m" in r.stderr, r.stderr


def test_in_the_terminal_ui_model_switches_and_the_status_bar_names_it(home, demo_path, gemma_it):
    from localchat.ui import status
    from tests.test_repl import Harness
    h = Harness(home, max_tokens=8, session="ui-switch", model=str(demo_path))
    try:
        h.say("My name is Ana.")
        h.wait(lambda: h.repl.session.app.is_running)
        h.type(f"/model {gemma_it}\r")
        h.wait(lambda: any("carried over as text" in p for p in h.printed), timeout=120)
        h.wait(lambda: h.repl.session.app.is_running)
        shown = status.toolbar_text(h.repl.bar)
        assert "Gemma 3 270m" in shown and "SmolLM2" not in shown  # the model by its own name
        st = h.say("What is my name?")
        assert st["recomputed_tokens"] <= st["new_tokens"] + 1 and h.ctl.rt.model.path == gemma_it
    finally:
        h.close()
        h.ctl.rt.close()


ESCAPING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | e }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_history_the_next_template_cannot_take_leaves_the_conversation_as_it_was(home, demo_path, tmp_path):
    escaping = edit_gguf(demo_path, tmp_path / "escaping.gguf", {"tokenizer.chat_template": ESCAPING})
    profile = runtime.load_profile("cpu", {**SETTINGS, "model": str(demo_path)})
    ctl = Session.open(runtime.open_runtime(profile, lambda text: None), SessionChoice(keep=False),
                       lambda text: None)  # no session: what is in memory is all there is
    try:
        ctl.turn("Invite ana & <b>bob</b>.")
        before = [(m.content, list(m.tokens)) for m in ctl.chat.conv.messages]
        with pytest.raises(LocalchatError, match="cannot be carried over to escaping.gguf"):
            modelswitch.switch_model(ctl, str(escaping))  # it writes "&amp;": the words are not found in it
        assert ctl.rt.model.path == demo_path and ctl.chat.conv.vocab == ctl.rt.engine.signature()
        assert [(m.content, m.tokens) for m in ctl.chat.conv.messages] == before  # untouched
        _official_and_exact(ctl)
        st = ctl.turn("And carol?")
        assert st.recomputed_tokens <= st.new_tokens + 1
    finally:
        _close(ctl)
