"""/model NAME: the session saved with its KV, the model unloaded, the next one loaded with the same
profile (its plan checked before it loads, once the card is free), the conversation carried over as text
and evaluated once; a model that cannot be used brings the one the chat had back."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from localchat import runtime
from localchat.chat import carryover
from localchat.chat.conversation import Conversation
from localchat.chat.documents import Document
from localchat.errors import ChatEnded, LocalchatError, ModelError, TemplateFailure, ToolsUnsupported
from localchat.machine import models
from localchat.runtime import Runtime
from localchat.session.lifecycle import Session


def listing(ctl: Session) -> str:
    """/model alone: the models found (the chat's marked), and how to switch."""
    current = ctl.rt.model.path.resolve()
    rows = [f"  {'*' if found.path.resolve() == current else ' '} {found.name:<40} {found.source}{_kind(found.path)}"
            for found in models.discover()]
    rows = rows or [f"  * {ctl.rt.model.name}"]
    return "\n".join(["models (* this chat's):", *rows, "/model NAME switches (a name above, a path or a built-in)"])


def _kind(path: Path) -> str:
    """What a listed model cannot be switched to for (its metadata read, bounded): "" for a chat model."""
    try:
        return "  (embeddings: for search by meaning, not a chat)" if models.model_info(path).embeds_only else ""
    except (LocalchatError, OSError):
        return "  (cannot be read)"


def switch_model(ctl: Session, name: str) -> str:
    """Load `name` in place of the chat's model and carry the conversation over; one line of what it cost.
    LocalchatError when it cannot (the chat goes on with its model, loaded again where it was unloaded);
    ChatEnded when not even that model loads again (the session is saved: resume it later)."""
    old = ctl.rt
    asked = old.requested or old.profile
    # a draft is made for one vocabulary, a projector for one model: the next model's own is found beside it
    profile = replace(asked, model=name, draft_model="", mmproj="off" if asked.mmproj == "off" else "auto")
    info = runtime.resolve_model(profile, ctl.report)
    info.check_loadable()  # a missing or damaged file is refused before anything is unloaded
    if ctl.store is not None:
        ctl.save()
    ctl.writer.wait()
    conv, pending = ctl.chat.conv, list(ctl.chat.docs.pending)
    carryover.keep_text(conv, old.engine)
    old.close()  # its memory first: the next model may need all of the card
    try:
        new = runtime.open_runtime(profile, ctl.report)
    except LocalchatError as exc:
        _reload(ctl, old, conv, pending)
        raise _said(exc) from None
    try:
        notes = _carry_tools(old, new)
        carryover.carry_over(new.chat, conv)
    except LocalchatError as exc:
        new.close()
        _reload(ctl, old, conv, pending)
        raise _said(exc) from None
    _carry_documents(new, pending)
    ctl.bind(new, ctl.prefix_cache is not None, changed=True)
    window = new.chat.conv.window_tokens()
    missing, took = ctl.kv.rebuild(window, _quiet) if len(window) <= new.engine.n_ctx else (0, 0.0)
    ctl.chat.ahead.warm_next_head()
    ctl.flush_events()
    turns = conv.turns
    said = f"model {new.model.path.name}: {turns} turn{'s' if turns != 1 else ''} carried over as text, "
    said += f"{missing:,} tokens evaluated in {took:.2f} s" if missing or not window else \
        f"older turns leave the window at the next turn (n_ctx {new.engine.n_ctx:,})"
    if asked.draft_model:
        notes += f"; the draft model {asked.draft_model} is off (it was made for the other vocabulary)"
    return said + notes


def _said(exc: LocalchatError) -> LocalchatError:
    """The next model's failure as a plain one-line error: a template that failed at its load is not
    the chat's own template failing (which ends line mode)."""
    return ModelError(str(exc)) if isinstance(exc, TemplateFailure) else exc


def _carry_tools(old: Runtime, new: Runtime) -> str:
    """The tools the old chat offered, offered by the new one where its template takes them."""
    if old.chat.tooling.runner is None:
        return ""
    try:
        new.chat.tooling.offer_of(old.chat.tooling, new.model.path.name)
    except ToolsUnsupported as exc:
        return f"; tools are off: {exc}"
    return ""


def _carry_documents(rt: Runtime, pending: list[Document]) -> None:
    """Documents attached and not sent yet go with the next message, in the new vocabulary."""
    rt.chat.docs.keep([Document(d.name, d.block, d.sha256, rt.engine.tokenize(d.block, special=False))
                       for d in pending])


def _reload(ctl: Session, old: Runtime, conv: Conversation, pending: list[Document]) -> None:
    """Back to the model the chat had, its conversation and KV as they were (from the state just saved)."""
    try:
        back = runtime.open_runtime(old.requested or old.profile, ctl.report)
    except LocalchatError as exc:
        ctl.end(f"{old.model.path.name} could not be loaded again ({exc})")
        raise ChatEnded(f"the chat cannot go on: {old.model.path.name} could not be loaded again ({exc}); "
                        "everything said is saved: resume it with --session or -c") from None
    _carry_tools(old, back)
    back.chat.docs.keep(pending)  # the same vocabulary: their tokens stand
    ctl.bind(back, ctl.prefix_cache is not None)
    if ctl.store is not None and ctl.store.transcript.exists():
        ctl.resume()
        return
    back.chat.adopt(conv)
    ctl.kv.rebuild(conv.window_tokens(), _quiet)
    back.chat.ahead.warm_next_head()


def _quiet(done: int, total: int) -> None:
    """No progress line: the switch says what it evaluated when it is done."""
