"""llama.cpp's sampler chains."""

from __future__ import annotations

import ctypes
import re
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import llama_cpp as lc
import numpy as np

from localchat.engine.types import SamplingConfig

# DRY's default sequence breakers (llama.cpp's): repetition across them is not penalized
_DRY_BREAKERS = ("\n", ":", "\"", "*")
MAX_REDRAWS = 32  # tokens refused in a row before the reply ends instead (never seen)


@dataclass(frozen=True)
class Constrained:
    """A sampler chain and a grammar, drawn as llama.cpp's common sampler draws them: the chain's token is
    checked against the grammar alone, and only a token it rejects makes the grammar filter the whole
    vocabulary before the chain draws again (the grammar over every candidate costs about 100 ms a token
    for SmolLM2's 49k-token vocabulary on 2 cores)."""

    chain: object
    grammar: object
    stateless: bool  # no DRY: the chain's own draw (which accepts its token) may be the first try
    triggers: tuple[re.Pattern[bytes], ...] = ()  # a lazy grammar's: free text until one of them matches
    probe: object | None = None  # the same grammar, not lazy: what a trigger's token would start is tried on a copy
    says_something: bool = False  # the reply does not end before it says something (a tool loop's after results)
    penalty: RecentPenalty | None = None  # the repeat penalty, applied before the chain


class RecentPenalty:
    """llama.cpp's repeat penalty, applied here: its penalty sampler looks every candidate up in its map of
    recent tokens (152k lookups a draw for Qwen's vocabulary: 0.65 of a 0.9 ms draw on 2 cores, and on a GPU
    the draw stands between two steps), where at most `last_n` logits change. The same float32 arithmetic on
    the same logits, so the same tokens."""

    def __init__(self, last_n: int, repeat: float):
        self.last_n, self.repeat = last_n, np.float32(repeat)
        self.recent: deque[int] = deque()
        self.counts: Counter[int] = Counter()

    def reset(self) -> None:
        self.recent.clear()
        self.counts.clear()

    def accept(self, tok: int) -> None:
        """As llama.cpp's penalty sampler accepts a token: the last `last_n` are counted (none where it is 0)."""
        if self.last_n <= 0:
            return
        self.counts[tok] += 1
        if len(self.recent) >= self.last_n:
            old = self.recent.popleft()
            self.counts[old] -= 1
            if not self.counts[old]:
                del self.counts[old]
        self.recent.append(tok)

    def apply(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The penalty on `values` (logits), in place; the tokens it changed and their values before."""
        ids = np.fromiter(self.counts, np.int64, len(self.counts))
        kept = values[ids]
        values[ids] = np.where(kept <= 0, kept * self.repeat, kept / self.repeat)  # float32, as llama.cpp's
        return ids, kept

    @contextmanager
    def applied(self, values: np.ndarray) -> Iterator[None]:
        """The penalty on llama.cpp's own logits for a draw, and put back after it."""
        ids, kept = self.apply(values)
        try:
            yield
        finally:
            values[ids] = kept


class Penalized:
    """A sampler chain after a repeat penalty applied by `RecentPenalty`."""

    def __init__(self, chain: object, penalty: RecentPenalty):
        self.chain = chain  # llama.cpp's: DRY, top-k, top-p, min-p, temperature, the draw
        self.penalty = penalty
        self.greedy = is_greedy(chain)

    def draw(self, ctx: object, i: int, n_vocab: int) -> int:
        """Output i's token, drawn from its logits penalized in place."""
        view = logits(ctx, i, n_vocab)
        with self.penalty.applied(view):
            tok = int(view.argmax()) if self.greedy else int(lc.llama_sampler_sample(self.chain, ctx, i))
        self.penalty.accept(tok)
        return tok


def make_sampler(s: SamplingConfig, vocab: object, n_ctx: int, grammar: object | None = None,
                 triggers: tuple[str, ...] = (), probe: object | None = None, says_something: bool = False) -> object:
    """The sampler for these settings, in llama.cpp's own order: the repeat penalty (`RecentPenalty`), then
    llama.cpp's chain: DRY, top-k, top-p, min-p, temperature and the draw (greedy at temperature 0); with a
    `grammar` sampler, the two as one `Constrained` (lazy from `triggers` on, `probe` being the same grammar
    from the start)."""
    chain = _chain(s, vocab, n_ctx, penalties=False)
    penalty = RecentPenalty(s.repeat_last_n, s.repeat_penalty) if s.repeat_penalty != 1.0 else None
    if grammar is None:
        return Penalized(chain, penalty) if penalty is not None else chain
    return Constrained(chain, grammar, s.dry_multiplier <= 0, tuple(re.compile(t.encode()) for t in triggers),
                       probe, says_something, penalty)


def _chain(s: SamplingConfig, vocab: object, n_ctx: int, penalties: bool = True) -> object:
    """llama.cpp's chain for `s`; with `penalties`, its own repeat penalty first (what `RecentPenalty` is checked
    against)."""
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    if penalties and s.repeat_penalty != 1.0:
        n_vocab = lc.llama_vocab_n_tokens(vocab)
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_penalties(n_vocab, s.repeat_last_n, s.repeat_penalty,
                                                                          0.0, 0.0))
    if s.dry_multiplier > 0:
        breakers = (ctypes.c_char_p * len(_DRY_BREAKERS))(*(b.encode() for b in _DRY_BREAKERS))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dry(
            # -1 must be spelled out: this API has lost the context size it once took, and DRY reads -1 as none
            vocab, s.dry_multiplier, s.dry_base, s.dry_allowed_length,
            s.dry_penalty_last_n if s.dry_penalty_last_n >= 0 else n_ctx, breakers,
            len(_DRY_BREAKERS)))
    if s.temperature <= 0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        return chain
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(s.top_k))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(s.top_p, 1))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_min_p(s.min_p, 1))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(s.temperature))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(s.seed))
    return chain


def is_greedy(chain: object) -> bool:
    """Whether the chain is the greedy draw alone (temperature 0, no penalties): its token is then the
    logits' first maximum, which the engine reads without the chain's candidate array."""
    return (not isinstance(chain, Penalized | Constrained) and lc.llama_sampler_chain_n(chain) == 1
            and lc.llama_sampler_name(lc.llama_sampler_chain_get(chain, 0)) == b"greedy")


def drawer(chain: object, ctx: object, vocab: object) -> Callable[[int], int]:
    """The chain's draw at output i (-1: the last). A greedy chain's token is the logits' first maximum,
    read here directly: the chain would build a candidate array of the whole vocabulary first (73 us
    a token for SmolLM2's 49k tokens, 6% of its step on an H200)."""
    if isinstance(chain, Constrained):
        return _constrained_drawer(chain, ctx, vocab)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    if isinstance(chain, Penalized):
        return lambda i: chain.draw(ctx, i, n_vocab)
    if not is_greedy(chain):
        return lambda i: lc.llama_sampler_sample(chain, ctx, i)
    return lambda i: int(logits(ctx, i, n_vocab).argmax())


class GraphDraw:
    """A greedy draw inside llama.cpp's graph (its experimental backend sampling): the argmax runs where
    the logits are and only the token comes back, not the vocabulary's logits (on a GPU the host's copy
    and argmax are about 0.5% of an 8B step). While it is attached, an output's raw logits are not kept."""

    def __init__(self, ctx: object):
        self.ctx = ctx
        lib = lc.llama_cpp._lib
        self._set = lib.llama_set_sampler
        self._set.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p]
        self._set.restype = ctypes.c_bool
        self._sampled = lib.llama_get_sampled_token_ith
        self._sampled.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        self._sampled.restype = ctypes.c_int32
        self.chain: object | None = None  # the greedy chain llama.cpp holds now
        # chains detached, kept until the context is freed: llama.cpp initializes a chain once (a second
        # attach aborts), and a graph it built with one may outlive the detach
        self.retired: list[object] = []
        self.refused = False  # llama.cpp could not put the draw in this backend's graph: not tried again

    @property
    def attached(self) -> bool:
        return self.chain is not None

    def attach(self, seq: int) -> bool:
        """Draw greedily in the graph from the next evaluation on; False where llama.cpp cannot."""
        if self.chain is not None or self.refused:
            return self.attached
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        if self._set(self.ctx, seq, chain):
            self.chain = chain
        else:
            self.refused = True
            self.retired.append(chain)
        return self.attached

    def detach(self, seq: int) -> None:
        if self.chain is not None:
            self._set(self.ctx, seq, None)
            self.retired.append(self.chain)
            self.chain = None

    def free(self) -> None:
        """After the context is freed."""
        for chain in self.retired + ([self.chain] if self.chain is not None else []):
            lc.llama_sampler_free(chain)
        self.retired, self.chain = [], None

    def token(self, i: int) -> int:
        return int(self._sampled(self.ctx, i))


def _constrained_drawer(s: Constrained, ctx: object, vocab: object) -> Callable[[int], int]:
    return _ConstrainedDraw(s, ctx, vocab).draw


class _ConstrainedDraw:
    """One reply's draws under a grammar: the chain's token first, checked against the grammar alone."""

    def __init__(self, s: Constrained, ctx: object, vocab: object):
        self.s, self.ctx, self.vocab = s, ctx, vocab
        self.n_vocab = lc.llama_vocab_n_tokens(vocab)
        self.data = (lc.llama_token_data * self.n_vocab)()
        self.view = np.ctypeslib.as_array(self.data)
        self.ids = np.arange(self.n_vocab, dtype=np.int32)
        self.one = (lc.llama_token_data * 1)()
        self.awaiting = bool(s.triggers)  # a lazy grammar waiting for its trigger
        self.text = bytearray()  # meanwhile, the reply so far (llama.cpp's trigger buffer)
        self.silent = True  # nothing but white space drawn yet

    def candidates(self, i: int) -> lc.llama_token_data_array:
        self.view["id"], self.view["logit"], self.view["p"] = self.ids, logits(self.ctx, i, self.n_vocab), 0.0
        if self.s.penalty is not None:
            self.s.penalty.apply(self.view["logit"])  # on the candidates' own copy of the logits
        return lc.llama_token_data_array(self.data, self.n_vocab, -1, False)

    def first_try(self, i: int) -> int:
        if self.s.stateless:  # in C, the whole vocabulary; what it accepts changes nothing
            if self.s.penalty is None:
                return int(lc.llama_sampler_sample(self.s.chain, self.ctx, i))
            with self.s.penalty.applied(logits(self.ctx, i, self.n_vocab)):
                return int(lc.llama_sampler_sample(self.s.chain, self.ctx, i))
        arr = self.candidates(i)
        lc.llama_sampler_apply(self.s.chain, ctypes.byref(arr))
        return int(arr.data[arr.selected].id)

    def redraw(self, i: int, refused: list[int]) -> int:
        """The chain's draw among what the grammar allows, the refused tokens left out."""
        arr = self.candidates(i)
        if not self.awaiting:
            lc.llama_sampler_apply(self.s.grammar, ctypes.byref(arr))
        self.view["logit"][refused] = -np.inf
        lc.llama_sampler_apply(self.s.chain, ctypes.byref(arr))
        return int(arr.data[arr.selected].id)

    def starts_well(self, tok: int) -> bool:
        """Whether the call a token's text would open (with what came before) is one the grammar takes:
        llama.cpp aborts on accepting a token whose trigger starts text its grammar refuses."""
        text = bytes(self.text) + _piece(self.vocab, tok)
        at = _trigger_at(self.s.triggers, text)
        return at < 0 or self.s.probe is None or _takes(self.s.probe, self.vocab, text[at:])

    def ends_unsaid(self, tok: int) -> bool:
        """Whether, with `says_something`, `tok` would end the reply before anything was said: an end of
        generation, or a control token that opens no call (a small model's <|im_start|> after results)."""
        if not (self.s.says_something and self.silent):
            return False
        if lc.llama_vocab_is_eog(self.vocab, tok):
            return True
        opens_call = _trigger_at(self.s.triggers, _piece(self.vocab, tok)) >= 0
        return bool(lc.llama_vocab_is_control(self.vocab, tok)) and not opens_call

    def refuses(self, tok: int) -> bool:
        if self.ends_unsaid(tok):
            return True
        return not self.starts_well(tok) if self.awaiting else not _grammar_takes(self.s.grammar, self.one, tok)

    def draw(self, i: int) -> int:
        s, tok, refused = self.s, self.first_try(i), list[int]()
        while self.refuses(tok):  # one loop: a token redrawn for one reason is checked for the other too
            refused.append(tok)
            if len(refused) > MAX_REDRAWS:
                tok = _end_of_text(self.vocab)
                break
            tok = self.redraw(i, refused)
        self.silent = self.silent and not _piece(self.vocab, tok).strip()
        if not s.stateless or refused:
            lc.llama_sampler_accept(s.chain, tok)
        if s.penalty is not None:
            s.penalty.accept(tok)
        if self.awaiting:
            self.text.extend(_piece(self.vocab, tok))
            self.awaiting = _trigger_at(s.triggers, bytes(self.text)) < 0
        lc.llama_sampler_accept(s.grammar, tok)
        return tok


def _trigger_at(triggers: tuple[re.Pattern[bytes], ...], text: bytes) -> int:
    """Where llama.cpp's lazy grammar starts in `text` (-1: it still waits): the first pattern that matches,
    from its first group that matched text, else from the match's start."""
    for pattern in triggers:
        m = pattern.search(text)
        if m:
            groups = [m.start(g) for g in range(1, pattern.groups + 1) if m.end(g) > m.start(g)]
            return groups[0] if groups else m.start()
    return -1


def _grammar_takes(grammar: object, one: ctypes.Array, tok: int) -> bool:
    one[0] = lc.llama_token_data(tok, 0.0, 0.0)
    lc.llama_sampler_apply(grammar, ctypes.byref(lc.llama_token_data_array(one, 1, -1, False)))
    return bool(one[0].logit != float("-inf"))


def _end_of_text(vocab: object) -> int:
    eot = lc.llama_vocab_eot(vocab)
    return eot if eot >= 0 else lc.llama_vocab_eos(vocab)


def _piece(vocab: object, tok: int) -> bytes:
    """A token's text as llama.cpp's grammar reads it (special tokens spelled out)."""
    buf = ctypes.create_string_buffer(256)
    n = lc.llama_token_to_piece(vocab, tok, buf, len(buf), 0, True)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = lc.llama_token_to_piece(vocab, tok, buf, len(buf), 0, True)
    return buf.raw[:max(n, 0)]


def _takes(probe: object, vocab: object, text: bytes) -> bool:
    """Whether the grammar, from its start, takes `text` (tried on a copy, token by token)."""
    cap = len(text) + 8
    tokens = (lc.llama_token * cap)()
    n = lc.llama_tokenize(vocab, text, len(text), tokens, cap, False, True)
    copy = lc.llama_sampler_clone(probe)
    one = (lc.llama_token_data * 1)()
    try:
        for tok in tokens[:max(n, 0)]:
            if not _grammar_takes(copy, one, tok):
                return False
            lc.llama_sampler_accept(copy, tok)
        return n >= 0
    finally:
        lc.llama_sampler_free(copy)


def free_sampler(sampler: object) -> None:
    """A sampler from make_sampler no longer used: its chain and grammars freed."""
    if isinstance(sampler, Constrained):
        for part in (sampler.chain, sampler.grammar, sampler.probe):
            if part is not None:
                lc.llama_sampler_free(part)
        return
    lc.llama_sampler_free(sampler.chain if isinstance(sampler, Penalized) else sampler)


def logits(ctx: object, i: int, n_vocab: int) -> np.ndarray:
    """Output i's logits, read in place (no copy)."""
    return np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,))


def prime(chain: object, s: SamplingConfig, tokens: list[int]) -> None:
    """Show the penalties (the repeat penalty, and DRY first in llama.cpp's chain) the context's last tokens,
    whatever was sampled before: a turn samples the same after a resume, /undo or /retry as in one sitting,
    and the penalties see the prompt, as llama-cli primes them. The draw's random state is left as it is."""
    windows = ([s.repeat_last_n] if s.repeat_penalty != 1.0 else []) + \
        ([len(tokens) if s.dry_penalty_last_n < 0 else s.dry_penalty_last_n] if s.dry_multiplier > 0 else [])
    if isinstance(chain, Constrained):
        lc.llama_sampler_reset(chain.grammar)  # a reply's grammar starts over (a lazy one waits for its trigger)
    penalty = chain.penalty if isinstance(chain, Constrained | Penalized) else None
    chain = chain.chain if isinstance(chain, Constrained | Penalized) else chain
    if penalty is not None:  # applied here, not one of llama.cpp's chain
        window = windows.pop(0)
        penalty.reset()
        for tok in tokens[len(tokens) - min(window, len(tokens)):]:
            if tok >= 0:
                penalty.accept(tok)
    for i, window in enumerate(windows):
        member = lc.llama_sampler_chain_get(chain, i)
        lc.llama_sampler_reset(member)
        for tok in tokens[len(tokens) - min(window, len(tokens)):]:
            if tok >= 0:  # an image's identity tokens are no vocabulary's (as int32 some would wrap into one)
                lc.llama_sampler_accept(member, tok)


def finite_logits(ctx: object, vocab: object, i: int = -1) -> bool:
    """Whether output i's logits are all finite numbers (a damaged file gives NaN or infinities)."""
    return bool(np.isfinite(logits(ctx, i, lc.llama_vocab_n_tokens(vocab))).all())
