"""The transcript and the token window the KV holds, derived from it; pure, no llama.cpp.

Every message keeps its exact tokens (user: the template's head before the words and the
body; assistant: the tokens as sampled), so the window is rebuilt token for token from the
transcript alone. An exchange spans from its user's body to the next user's body, so taking
the oldest exchanges out leaves a well-formed prompt: the prefix ends with a user header.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime


@dataclass
class Message:
    role: str  # user, assistant or tool (a tool's result)
    content: str
    tokens: list[int] = field(default_factory=list)  # user: words + generation prompt; reply: as sampled
    head: list[int] = field(default_factory=list)  # user: closing of the previous reply + user header
    cut: bool = False  # a reply stopped early (Ctrl-C, end of context)
    in_window: bool = True  # False once its tokens have left the context window
    pinned: bool = False  # never leaves the window
    raw: str = ""  # a reply as sampled, special tokens written out (its thoughts, channels); templates get this
    reasoning: str = ""  # a reply's thoughts (its content is the answer)
    documents: list[dict] = field(default_factory=list)  # user: files whose blocks open the content, in order
    calls: list[dict] = field(default_factory=list)  # assistant: the tool calls it made ({name, arguments, id})
    call_at: int = -1  # assistant: where its calls start in `raw` (the text before them is its content)
    call: dict = field(default_factory=dict)  # tool: the call this result answers ({name, id}) and its status
    at: str = field(default_factory=lambda: datetime.now().isoformat(timespec="seconds"))  # when it was made

    @property
    def doc_chars(self) -> int:
        return sum(d["chars"] for d in self.documents)

    @property
    def doc_tokens(self) -> int:
        """The documents' tokens at the start of `tokens`, each block tokenized on its own."""
        return sum(d["tokens"] for d in self.documents)

    @property
    def words(self) -> str:
        """What the user typed, without the attached documents."""
        return self.content[self.doc_chars:]

    def to_json(self) -> dict:
        # by hand: dataclasses.asdict deep-copies every token, a millisecond on the turn's critical path
        d = {"role": self.role, "content": self.content, "tokens": list(self.tokens), "head": list(self.head),
             "cut": self.cut, "in_window": self.in_window, "pinned": self.pinned}
        d.update({k: v for k, v in (("raw", self.raw), ("reasoning", self.reasoning),
                                    ("documents", self.documents), ("calls", self.calls),
                                    ("call", self.call), ("at", self.at)) if v})
        if self.calls:
            d["call_at"] = self.call_at
        return d


SUMMARY_HEAD = "Notes on the earlier part of this conversation (its turns were folded to make room):"


@dataclass
class Conversation:
    system: str | None = None
    prefix: list[int] = field(default_factory=list)  # system prompt and first user header
    messages: list[Message] = field(default_factory=list)
    tokens_left_window: int = 0
    started: str = ""  # when the chat began (ISO): the date templates print stays that day's on resume
    vocab: str = ""  # the signature of the vocabulary its tokens are in ("": as the model's, an older transcript)
    summary: str = ""  # the model's summary of the turns compaction folded out of the window
    last_compaction: dict | None = None  # what /compact undo restores: {"users", "tokens", "summary", "turns"}

    @property
    def turns(self) -> int:
        return sum(1 for m in self.messages if m.role == "user")

    @property
    def turns_left_window(self) -> int:
        return sum(1 for m in self.messages if m.role == "user" and not m.in_window)

    def system_text(self) -> str | None:
        """The system prompt as the template writes it: with the summary of the folded turns after it."""
        if not self.summary:
            return self.system
        return f"{self.system}\n\n{SUMMARY_HEAD}\n{self.summary}" if self.system else f"{SUMMARY_HEAD}\n{self.summary}"

    def fold(self, user_indices: list[int], n_tokens: int, summary: str) -> None:
        """Compaction: these exchanges leave the window, `summary` stands for them (and for any summary before)."""
        self.last_compaction = {"users": list(user_indices), "tokens": n_tokens, "summary": self.summary,
                                "turns": self.turns}
        self.evict(user_indices, n_tokens)
        self.summary = summary

    def unfold(self) -> bool:
        """The last compaction undone (only while no turn followed it): its exchanges back in the window."""
        last = self.last_compaction
        if last is None or last["turns"] != self.turns:
            return False
        for idx in last["users"]:
            for m in self.messages[idx:]:
                if m.role == "user" and m is not self.messages[idx]:
                    break
                m.in_window = True
        self.tokens_left_window -= last["tokens"]
        self.summary, self.last_compaction = last["summary"], None
        return True

    def _window(self) -> list[Message]:
        return [m for m in self.messages if m.in_window]

    def window_tokens(self) -> list[int]:
        """The tokens the KV should hold, rebuilt from the transcript."""
        out = list(self.prefix)
        for i, m in enumerate(self._window()):
            if m.role != "assistant" and i > 0:
                out.extend(m.head)
            out.extend(m.tokens)
        return out

    def exchange_spans(self) -> list[tuple[int, int, int]]:
        """(message index of the user turn, first token, end token) of each exchange in the window."""
        spans: list[list[int]] = []
        pos = len(self.prefix)
        for idx, m in enumerate(self.messages):
            if not m.in_window:
                continue
            if m.role == "user":
                if spans:
                    pos += len(m.head)
                    spans[-1][2] = pos
                spans.append([idx, pos, pos])
            elif m.role == "tool":
                pos += len(m.head)
            pos += len(m.tokens)
            spans[-1][2] = pos
        return [(a, b, c) for a, b, c in spans]

    def add_user(self, text: str, head: list[int], tokens: list[int], documents: list[dict] | None = None) -> Message:
        m = Message("user", text, tokens=list(tokens), head=list(head), documents=list(documents or []))
        self.messages.append(m)
        return m

    def add_reply(self, text: str, tokens: list[int], cut: bool, reasoning: str = "",
                  calls: list[dict] | None = None) -> Message:
        m = Message("assistant", text, tokens=list(tokens), cut=cut, reasoning=reasoning, calls=list(calls or []))
        self.messages.append(m)
        return m

    def add_result(self, text: str, head: list[int], tokens: list[int], call: dict) -> Message:
        m = Message("tool", text, tokens=list(tokens), head=list(head), call=dict(call))
        self.messages.append(m)
        return m

    def user_indices(self) -> list[int]:
        """Where each turn's user message is (turn N at [N - 1])."""
        return [i for i, m in enumerate(self.messages) if m.role == "user"]

    def cut_before_turn(self, turn: int) -> list[Message]:
        """Forget turn `turn` (from 1) and every message after it (a fork that edits it); returns them."""
        at = self.user_indices()[turn - 1]
        dropped = self.messages[at:]
        del self.messages[at:]
        return dropped

    def drop_last_exchange(self) -> list[Message]:
        """Forget the last user message and its reply (undo); returns what was dropped."""
        last_user = max(i for i, m in enumerate(self.messages) if m.role == "user")
        dropped = self.messages[last_user:]
        del self.messages[last_user:]
        return dropped

    def relayout(self, prefix: list[int], layout: list[tuple[int, list[int], list[int]]]) -> None:
        """Give messages new token layouts (message index, head, tokens): the official form of the
        history. Their text is unchanged; only what the KV holds for them."""
        self.prefix = list(prefix)
        for idx, head, tokens in layout:
            self.messages[idx].head, self.messages[idx].tokens = list(head), list(tokens)

    def pin_last(self) -> bool:
        """Keep the last exchange in the window when the context fills; False when there is none."""
        users = [m for m in self.messages if m.role == "user" and m.in_window]
        if users:
            users[-1].pinned = True
        return bool(users)

    def evictable(self) -> list[tuple[int, int, int]]:
        """Exchanges that may leave the window, oldest first (not pinned)."""
        return [s for s in self.exchange_spans() if not self.messages[s[0]].pinned]

    def evict(self, user_indices: list[int], n_tokens: int) -> None:
        for idx in user_indices:
            self.messages[idx].in_window = False
            for m in self.messages[idx + 1:]:  # its reply, and the tool calls and results of the exchange
                if m.role == "user":
                    break
                m.in_window = False
        self.tokens_left_window += n_tokens

    def to_json(self) -> dict:
        return {"system": self.system, "summary": self.summary, "prefix": self.prefix,
                "tokens_left_window": self.tokens_left_window,
                "started": self.started, "messages": [m.to_json() for m in self.messages]}
