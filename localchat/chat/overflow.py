"""When the context fills: the oldest exchanges leave the window (never the system prompt or pinned
ones); shifted down in the KV without recomputing where the cache allows, else recomputed."""

from __future__ import annotations

from localchat.chat import transcript
from localchat.chat.ahead import Ahead
from localchat.chat.conversation import Conversation
from localchat.chat.stats import TurnStats
from localchat.engine import Engine
from localchat.errors import ContextFullError


def make_room(e: Engine, conv: Conversation, ahead: Ahead, policy: str, need: int,
              st: TurnStats) -> transcript.Record | None:
    """Take the oldest exchanges out of the window until `need` more tokens fit (policy: shift, rebuild,
    stop); the transcript record of what left, if anything did."""
    window = conv.window_tokens()
    if len(window) + need <= e.n_ctx:
        return None
    if policy == "stop":
        raise ContextFullError(
            f"the context is full ({len(window)} of {e.n_ctx} tokens): /new starts a new chat, "
            "a larger --ctx holds more, or set overflow: shift in the profile")
    margin = e.n_ctx // 8
    chosen: list[tuple[int, int, int]] = []
    freed = 0
    for idx, start, end in conv.evictable():
        if len(window) - freed + need + margin <= e.n_ctx and chosen:
            break
        chosen.append((idx, start, end))
        freed += end - start
    if not chosen:
        return None
    held = min(e.n_kv, len(window))  # a warmed head may follow the window
    in_sync = e.tokens[:held] == window[:held] and held >= chosen[-1][2]
    # a sliding-window cache holds only recent positions: after the shift, the window of the
    # next token must fall inside the kept tail, or its oldest positions would be missing
    window_safe = not e.n_swa or e.config.swa_full or e.n_kv - chosen[-1][2] >= e.n_swa
    if policy == "shift" and e.can_shift and in_sync and window_safe:
        for _, start, end in reversed(chosen):
            e.shift_out(start, end - start)
        ahead.shifted(freed)  # what was evaluated ahead moved down with the rest
    else:
        ahead.invalidate()  # the kept window is recomputed: nothing ahead can be credited
    conv.evict([c[0] for c in chosen], freed)
    st.shifted_tokens = freed
    return transcript.evict([c[0] for c in chosen], freed)
