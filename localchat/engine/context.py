"""The llama.cpp context: a token-canonical KV, reuse/rewind/shift, generation, state copy.

It uses llama.cpp's C API through llama-cpp-python's bindings rather than the `Llama` class,
which keeps an n_batch x n_vocab float array on the host (0.5 GiB with a 262k vocabulary).
"""

from __future__ import annotations

import codecs
import ctypes
import time
from collections.abc import Callable, Generator, Iterable

import llama_cpp as lc

from localchat.engine.backend import SEQ, buffers, context_params, init_backend, model_params, start_buffer_log
from localchat.engine.grammar import grammar_sampler
from localchat.engine.loadlog import LOAD_LOG, explain
from localchat.engine.media import Embedding, MediaTable, run_of
from localchat.engine.pinned import Staging
from localchat.engine.positions import Positions
from localchat.engine.sampling import Constrained, GraphDraw, drawer, finite_logits, is_greedy, make_sampler
from localchat.engine.speculative import Speculation, verify
from localchat.engine.stepcost import StepCost
from localchat.engine.types import Cancelled, EngineConfig, Generation, PrefillResult, SamplingConfig
from localchat.engine.vocab import VocabText
from localchat.errors import DamagedModel, DocumentError, ModelError
from localchat.trace import TRACE

FA_TILE = 64  # queries per tile of llama.cpp's CPU flash attention (GGML_FA_TILE_Q)
WARM_UP_TOKENS = 512  # a prompt's batch, as a turn's first evaluation makes (one ubatch by default)


class Engine(VocabText):
    def __init__(self, config: EngineConfig):
        init_backend(config.verbose)
        self.config = config
        start_buffer_log()
        LOAD_LOG.start()
        try:
            self.model = lc.llama_model_load_from_file(config.model_path.encode(), model_params(config))
        finally:
            LOAD_LOG.stop()
        if not self.model:
            raise ModelError(explain(config.model_path, LOAD_LOG.reason()))
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.sequences = config.sequences if _parks(self.model) else 1
        self.ctx = lc.llama_init_from_model(self.model, context_params(config, self.sequences))
        # kind (model, KV, compute, output) -> buffer (CPU, CUDA0, CUDA_Host) -> bytes llama.cpp allocated
        self.buffers = buffers()
        self.kv_buffers = self.buffers.get("KV", {})
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise ModelError("llama.cpp could not create the context: too little memory for this n_ctx/KV type? "
                             "(see 'localchat plan'; --verbose shows llama.cpp's log)")
        self.threads = (config.threads(), config.batch_threads())
        self.mem = lc.llama_get_memory(self.ctx)
        self.n_ctx = lc.llama_n_ctx(self.ctx)
        self.n_swa = lc.llama_model_n_swa(self.model)
        self.can_shift = bool(lc.llama_memory_can_shift(self.mem))
        self.mrope = lc.llama_model_rope_type(self.model) in (lc.LLAMA_ROPE_TYPE_MROPE, lc.LLAMA_ROPE_TYPE_IMROPE)
        self._batch = lc.llama_batch_init(config.n_batch, 0, 1)
        for i in range(config.n_batch):  # every token belongs to the one sequence
            self._batch.n_seq_id[i] = 1
            self._batch.seq_id[i][0] = SEQ
        self._batch_tokens = (lc.llama_token * config.n_batch).from_address(
            ctypes.addressof(self._batch.token.contents))
        self._batch_pos = (lc.llama_pos * config.n_batch).from_address(ctypes.addressof(self._batch.pos.contents))
        # padding batches pays where llama.cpp's CPU flash attention runs every layer, and only where the
        # padding can leave the KV again exactly (no sliding window, no recurrent state)
        self._pads = (config.n_gpu_layers == 0 and config.flash_attn and not self.n_swa
                      and not lc.llama_model_is_recurrent(self.model) and not lc.llama_model_is_hybrid(self.model))
        self.padded = 0  # padding tokens evaluated since reset_perf
        self.overlaps, self.queues = _offloaded(config, self.model)
        self.step_cost = StepCost(gpu=self.overlaps)
        # a greedy reply's draw in llama.cpp's graph where a GPU computes it (tests turn it on for the CPU)
        self.graph_draw: GraphDraw | None = GraphDraw(self.ctx) if self.overlaps else None
        self.drawn_in_graph = False  # the last evaluation that kept logits drew its token in the graph instead
        self.tokens: list[int] = []  # the token-canonical history this context holds
        self.n_kv = 0  # how many of self.tokens are evaluated into the KV (the rest are pending)
        self.logits_end = -1  # the KV length whose last token's logits llama.cpp holds now (-1: none)
        self._piece_buf = ctypes.create_string_buffer(256)
        self.media = MediaTable()  # the embeddings behind the identity tokens of images (engine.media)
        self.media.n_embd = lc.llama_model_n_embd_inp(self.model)
        self.media.mrope = self.mrope  # an encoding cached for a model of the other placement is not taken
        self._embd_batch: lc.llama_batch | None = None  # made with the first image evaluated
        self.positions = Positions()  # where M-RoPE images (Qwen-VL) place the tokens after them
        self._mrope_pos: ctypes.Array | None = None  # an image batch's positions, four sections a row
        self._embd_own_pos = 0  # the address of the image batch's own positions array
        # state copies through pinned memory: llama.cpp copies a state through the caller's buffer
        self.staging = Staging(config.pinned_bytes) if config.pinned_bytes and self.overlaps else None
        self._make_room: Callable[[], bool] | None = None  # see when_full

    # ------------------------------------------------------------------ vocabulary
    # ------------------------------------------------------------------ KV bookkeeping
    def pos_min(self) -> int:
        return lc.llama_memory_seq_pos_min(self.mem, SEQ)

    def can_rewind_to(self, n: int) -> bool:
        """Whether the KV may be cut back to n tokens and stay exact (sliding-window check)."""
        if n >= self.n_kv or n == 0 or self.n_swa == 0 or self.config.swa_full:
            return True
        # positions the window still needs for a token at n must all be held
        return self.pos_min() <= max(0, self.positions.at(n) - self.n_swa)

    def _truncate_kv(self, n: int) -> bool:
        """Drop KV beyond n tokens; on an unsafe sliding-window rewind drop all. True if kept."""
        if n >= self.n_kv:
            return True
        self.logits_end = -1
        if self.can_rewind_to(n) and self.forget_from(n):
            self.n_kv = n
            return True
        self._clear_kv()
        self.n_kv = 0
        return False

    def forget_from(self, n: int) -> bool:
        """Drop the KV from the history's token n on (never inside an image's run), at its position; the
        caller checks the sliding window and sets n_kv."""
        done = bool(lc.llama_memory_seq_rm(self.mem, SEQ, self.positions.at(n), -1))
        self.positions.forget_from(n)
        return done

    def _clear_kv(self) -> None:
        if self.sequences > 1:  # the parked sequences stay
            lc.llama_memory_seq_rm(self.mem, SEQ, -1, -1)
        else:
            lc.llama_memory_clear(self.mem, True)
        self.positions.clear()

    # ------------------------------------------------------------------ parked sequences
    def park(self, seq: int) -> bool:
        """The KV's evaluated tokens kept in sequence `seq` too (their cells shared, nothing copied), to `unpark`
        later; False where this context has no such sequence or the history holds placed image chunks."""
        if not 0 < seq < self.sequences - 1 or self.positions.ends or not self.n_kv:  # the last is load_chain's
            return False
        lc.llama_memory_seq_rm(self.mem, seq, -1, -1)
        lc.llama_memory_seq_cp(self.mem, SEQ, seq, 0, self.n_kv)
        return True

    def unpark(self, seq: int, tokens: list[int]) -> bool:
        """The KV becomes what `seq` holds (`tokens`, as parked); the sequence is free again."""
        self._clear_kv()
        self.tokens, self.n_kv, self.logits_end = [], 0, -1
        lc.llama_memory_seq_cp(self.mem, seq, SEQ, -1, -1)
        lc.llama_memory_seq_rm(self.mem, seq, -1, -1)
        if not tokens or lc.llama_memory_seq_pos_max(self.mem, SEQ) != len(tokens) - 1:
            self._clear_kv()
            return False
        self.tokens, self.n_kv = list(tokens), len(tokens)
        return True

    def drop(self, seq: int) -> None:
        """A parked sequence's cells freed (those it shares stay with the others)."""
        lc.llama_memory_seq_rm(self.mem, seq, -1, -1)

    def when_full(self, make_room: Callable[[], bool]) -> None:
        """`make_room` is asked when llama.cpp finds no free cells (parked sequences hold them): True if it freed
        some (the evaluation is tried again)."""
        self._make_room = make_room

    def _room_made(self, rc: int) -> bool:
        """After llama.cpp found no free cells (rc 1): whether parked sequences gave some back (then try again)."""
        return rc == 1 and self._make_room is not None and self._make_room()

    def truncate(self, n: int) -> None:
        """Cut the history back to its first n tokens (undo, stop strings)."""
        self.tokens = self.tokens[:n]
        self._truncate_kv(n)

    def clear(self) -> None:
        self._clear_kv()
        self.tokens, self.n_kv, self.logits_end = [], 0, -1

    def shift_out(self, start: int, count: int) -> None:
        """Remove tokens [start, start+count) and slide the rest down, recomputing nothing."""
        if not self.can_shift:
            raise ModelError("this model's KV cache cannot shift positions; use overflow: rebuild")
        end = start + count
        if end > self.n_kv:
            raise ValueError("shift beyond the evaluated KV")
        if self.positions.ends:  # M-RoPE: llama.cpp has no shift for it (can_shift is false), and aborts
            raise ModelError("this model's KV cache cannot shift positions; use overflow: rebuild")
        lc.llama_memory_seq_rm(self.mem, SEQ, start, end)
        lc.llama_memory_seq_add(self.mem, SEQ, end, -1, -count)
        del self.tokens[start:end]
        self.n_kv -= count
        self.logits_end = -1

    # ------------------------------------------------------------------ evaluation
    def _padding(self, n: int, pos: int) -> int:
        """Tokens to add past a prompt batch of n at `pos`, so that llama.cpp's CPU flash attention takes
        its tiled path (64 queries or more; fewer go one by one, about 6x slower per token at depth), where
        that is cheaper; they leave the KV at once. The costs are fitted on the 2-core VM (BENCHMARKS.md)."""
        if not self._pads or n < 2 or n >= FA_TILE or pos + FA_TILE > self.n_ctx:
            return 0
        return FA_TILE - n if n * (1 + pos / 200) > 60 + 0.04 * pos else 0

    def _decode(self, tokens: list[int], start_pos: int, want_logits: bool, all_logits: bool = False,
                pad: int = 0) -> None:
        """Evaluate `tokens` from `start_pos`; `pad` more (copies of the last) evaluated beside them and
        then dropped from the KV: the batch's shape only, never its history."""
        if tokens and min(tokens) < 0:  # an image's identity tokens among them
            self._decode_runs(tokens, start_pos, want_logits, all_logits)
            return
        b = self._batch
        real = len(tokens)
        tokens = tokens + tokens[-1:] * pad
        n = len(tokens)
        # whole-slice stores run in C: element by element costs ~0.2 ms per 150 tokens in Python
        self._batch_tokens[:n] = tokens  # type: ignore[assignment]  # ctypes takes a list of ints
        first = self.positions.at(start_pos)
        self._batch_pos[:n] = range(first, first + n)  # type: ignore[call-overload]  # and a range
        ctypes.memset(b.logits, int(all_logits), n)
        if want_logits:
            b.logits[real - 1] = 1
        b.n_tokens = n
        self.logits_end = start_pos + real if want_logits and not all_logits else -1
        self.drawn_in_graph = want_logits and self.graph_draw is not None and self.graph_draw.attached
        rc = lc.llama_decode(self.ctx, b)
        while rc != 0 and self._room_made(rc):
            rc = lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise ModelError(f"llama_decode failed (code {rc}): the KV cache is full or out of memory")
        if pad and not lc.llama_memory_seq_rm(self.mem, SEQ, first + real, -1):
            raise ModelError("llama.cpp could not drop a batch's padding from the KV")
        self.padded += pad

    def _decode_runs(self, tokens: list[int], start_pos: int, want_logits: bool, all_logits: bool) -> None:
        """Evaluate text and image runs in order: text as tokens, each image run from its embeddings."""
        if all_logits:
            raise ValueError("a batch that wants every position's logits (a draft's verification) holds no image")
        at = 0
        while at < len(tokens):
            end = _segment_end(tokens, at)
            last = end == len(tokens) and want_logits
            if tokens[at] < 0:
                self._decode_embeddings(tokens[at:end], start_pos + at, last)
            else:
                self._decode(tokens[at:end], start_pos + at, last)
            at = end

    def _decode_embeddings(self, run: list[int], start_pos: int, want_logits: bool) -> None:
        """Consecutive rows of one image chunk evaluated from its embeddings: a non-causal chunk (its positions
        see each other) in one batch with causal attention off, as libmtmd evaluates it; a causal one in
        batches of n_batch."""
        chunk, first = run_of(run[0])
        emb = self.media.get(chunk)
        if first + len(run) > emb.n:
            raise ModelError("an image's tokens run past its embeddings: the session's tokens are damaged")
        if bool(emb.nx) != self.mrope or (emb.nx and first):  # the media table takes only this model's placement
            raise ModelError("an image's tokens are not placed as this model places them: the session is damaged")
        ubatch = min(self.config.n_ubatch, self.config.n_batch)
        if emb.non_causal and len(run) > ubatch:
            raise DocumentError(f"an image of {len(run)} positions that see each other is evaluated in one batch: "
                                f"raise n_ubatch and n_batch to at least {len(run)}")
        step = len(run) if emb.non_causal else self.config.n_batch
        for at in range(0, len(run), step):
            n = min(step, len(run) - at)
            self._decode_rows(emb, first + at, n, start_pos + at, want_logits and at + n == len(run))
        if emb.nx and first + len(run) == emb.n:  # the chunk's n_pos positions, not its rows, are taken
            self.positions.record(start_pos - first, start_pos + len(run), emb.n_pos)

    def _decode_rows(self, emb: Embedding, row: int, n: int, start_pos: int, want_logits: bool) -> None:
        width = self.media.n_embd * 4
        if self._embd_batch is None:
            self._embd_batch = lc.llama_batch_init(self.config.n_batch, self.media.n_embd, 1)
            # the field read back aliases the struct: its own array's address is kept, for llama_batch_free
            self._embd_own_pos = ctypes.cast(self._embd_batch.pos, ctypes.c_void_p).value or 0
        batch = self._embd_batch
        ctypes.memmove(batch.embd, emb.data[row * width:(row + n) * width], n * width)
        first = self.positions.at(start_pos - row)  # the chunk's first position (M-RoPE: every row's time)
        for i in range(n):
            batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = first + row + i, 1, SEQ, 0
        batch.logits[n - 1] = int(want_logits)
        batch.n_tokens = n
        self.logits_end = start_pos + n if want_logits else -1
        self.drawn_in_graph = want_logits and self.graph_draw is not None and self.graph_draw.attached
        if emb.nx:
            batch.pos = self._grid_positions(first, emb.nx, row, n)
        if emb.non_causal:
            lc.llama_set_causal_attn(self.ctx, False)
        try:
            rc = lc.llama_decode(self.ctx, batch)
            while rc != 0 and self._room_made(rc):
                rc = lc.llama_decode(self.ctx, batch)
        finally:  # a Ctrl-C raised as the call returns must not leave our array for llama_batch_free to free
            batch.pos = ctypes.cast(self._embd_own_pos, ctypes.POINTER(lc.llama_pos))
            if emb.non_causal:
                lc.llama_set_causal_attn(self.ctx, True)
        if rc != 0:
            raise ModelError(f"llama_decode failed on an image (code {rc}): the KV cache is full or out of memory")

    def _grid_positions(self, first: int, nx: int, row: int, n: int) -> ctypes._Pointer:
        """Rows [row, row + n) of an M-RoPE chunk at `first`, as libmtmd places them: four sections of n
        (time, grid row, grid column, unused)."""
        if self._mrope_pos is None:
            self._mrope_pos = (lc.llama_pos * (4 * self.config.n_batch))()
        pos = self._mrope_pos
        rows = range(row, row + n)
        pos[0:n] = [first] * n
        pos[n:2 * n] = [first + i // nx for i in rows]
        pos[2 * n:3 * n] = [first + i % nx for i in rows]
        pos[3 * n:4 * n] = [0] * n
        return ctypes.cast(pos, ctypes.POINTER(lc.llama_pos))

    def run_start(self, tokens: list[int], n: int) -> int:
        """`n`, or the start of the image run that a cut after n tokens would leave in part: a run is evaluated
        or dropped whole."""
        if 0 < n <= len(tokens) and tokens[n - 1] < 0:
            run, row = run_of(tokens[n - 1])
            cut = _continues(tokens, n) if n < len(tokens) else row + 1 < self.media.length(run)
            if cut:
                return n - row - 1
        return n

    def _batch_end(self, tokens: list[int], start: int, limit: int) -> int:
        """The end of the next batch from `start`, at most `limit` tokens long, never inside an image run:
        a run alone longer than the limit goes whole (its embeddings are evaluated in pieces where they may
        be); a run that `tokens` holds only in part is not evaluated."""
        end = min(len(tokens), start + limit)
        cut = self.run_start(tokens, end)
        if cut > start or end == len(tokens):
            return cut
        while end < len(tokens) and _continues(tokens, end):
            end += 1
        return self.run_start(tokens, end)

    def prefill(self, prompt: list[int], progress: Callable[[int, int], None] | None = None,
                cancelled: Callable[[], bool] | None = None,
                queued: Callable[[], None] | None = None) -> PrefillResult:
        """Make the KV hold `prompt`, evaluating only what it lacks; logits ready for the last token. Its seconds
        are the work's, done: a GPU's llama_decode returns once the work is queued (the restore chooser took a
        prefill speed 3x too fast from that on the H100), and llama.cpp books its counters here. `queued` is
        called once the first batch is handed to llama.cpp (where it `queues`, the host's work in it is done while
        the GPU computes); not where nothing is evaluated."""
        t0 = time.perf_counter()
        if len(prompt) > self.n_ctx:
            raise ModelError(f"the prompt ({len(prompt)} tokens) is larger than the context ({self.n_ctx})")
        same = self.common_prefix(prompt)
        first_diff = same if same < self.n_kv else -1
        # the last prompt token is evaluated for its logits, unless they are those of the work done ahead
        ready = same == len(prompt) == self.n_kv == self.logits_end
        keep = len(prompt) if ready else self.run_start(prompt, min(same, len(prompt) - 1))
        refused = keep < self.n_kv and not self.can_rewind_to(keep)
        if not self._truncate_kv(keep):
            keep = 0
        self.tokens = list(prompt[:keep])
        pos = keep
        while pos < len(prompt):
            if cancelled and cancelled():
                raise Cancelled()
            chunk = prompt[pos:self._batch_end(prompt, pos, self.config.n_batch)]
            if not chunk:  # a prompt that ends inside an image: no batch can hold it whole
                raise ValueError("a prompt must not end inside an image's run")
            self._decode(chunk, pos, want_logits=pos + len(chunk) == len(prompt),
                         pad=self._padding(len(chunk), pos))
            pos += len(chunk)
            self.tokens.extend(chunk)
            self.n_kv = pos
            if queued is not None:
                call, queued = queued, None
                call()
            if progress:
                progress(pos - keep, len(prompt) - keep)
        self.synchronize()
        return PrefillResult(keep, len(prompt) - keep, time.perf_counter() - t0, first_diff, refused)

    def common_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` the KV already holds (evaluated, not pending)."""
        limit = min(self.n_kv, len(tokens))
        if self.tokens[:limit] == tokens[:limit]:  # the usual case, compared in C
            return limit
        same = 0
        while same < limit and self.tokens[same] == tokens[same]:
            same += 1
        return same

    def advance(self, target: list[int], max_tokens: int, logits: bool = False) -> tuple[int, int]:
        """Bring the KV one batch closer to holding `target` (work done while the user is not waiting):
        rewind to the common prefix, then evaluate at most `max_tokens` more of it; with `logits`, the
        batch that ends it keeps the last token's logits, for a prefill of just `target` to sample from.
        Returns (tokens evaluated, tokens rewound); a rewind the sliding window forbids empties the KV."""
        same = self.run_start(target, self.common_prefix(target))
        rewound = self.n_kv - same
        if rewound and not self._truncate_kv(same):
            rewound = same + rewound  # everything was dropped
        room = max(0, min(max_tokens, self.config.n_batch, self.n_ctx - self.n_kv))
        chunk = target[self.n_kv:self._batch_end(target, self.n_kv, room) if room else self.n_kv]
        if chunk:
            ends = logits and self.n_kv + len(chunk) == len(target)
            if ends and self.overlaps and len(chunk) > 1 and chunk[-1] >= 0:
                # the last token alone: the reply's first one-token step reuses its graph instead of building
                # one on the way to the first text (llama.cpp rebuilds it when the batch shape changes)
                self._decode(chunk[:-1], self.n_kv, want_logits=False)
                self._decode(chunk[-1:], self.n_kv + len(chunk) - 1, want_logits=True)
            else:
                self._decode(chunk, self.n_kv, want_logits=ends)
            self.synchronize()  # done within this step, and booked in llama.cpp's counters now
        # one assignment: a pending sampled token is replaced by what was evaluated in its place
        self.tokens[self.n_kv:] = chunk
        self.n_kv += len(chunk)
        return len(chunk), rewound

    def synchronize(self) -> None:
        """Wait for queued evaluation to finish (llama.cpp also books its perf counters here)."""
        lc.llama_synchronize(self.ctx)

    def set_threads(self, decode: int, batch: int) -> None:
        """CPU threads for one-token steps and for batches, from the next evaluation on."""
        lc.llama_set_n_threads(self.ctx, decode, batch)
        self.threads = (decode, batch)

    def make_sampler(self, s: SamplingConfig, gbnf: str = "", triggers: tuple[str, ...] = (),
                     says_something: bool = False) -> object:
        """The sampler chain for `s`; with `gbnf`, constrained by that grammar (lazy: from a trigger on); with
        `says_something` (a grammar's only), a reply's first token never ends it."""
        if not gbnf:
            return make_sampler(s, self.vocab, self.n_ctx)
        probe = grammar_sampler(self.vocab, gbnf) if triggers else None
        return make_sampler(s, self.vocab, self.n_ctx, grammar_sampler(self.vocab, gbnf, triggers), triggers, probe,
                            says_something)

    def generate(self, sampler, max_tokens: int, gen: Generation, cancelled: Callable[[], bool] | None = None,
                 inject: Callable[[], list[int]] | None = None,
                 spec: Speculation | None = None) -> Generator[str, None, None]:
        """Stream reply text after a prefill. Sampled tokens join self.tokens as sampled; the last one
        is pending (not yet in the KV) until the next prefill evaluates it, or already evaluated where
        the reply stopped after its evaluation began. `inject`, asked after each token is handed out:
        tokens the reply must go on with (a thought budget's end marker). `spec`: draft from the
        context's history and verify in batches (not with `inject`)."""
        draw = self._drawer(sampler)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        ahead: list[int] = []  # drawn by a verification batch: all in the KV but the last
        step: tuple[float, int, int] | None = None  # the step in flight: its start, tokens it hands out, drafted
        started = False  # the next evaluation was started before the last token was handed out
        try:
            for i in range(max_tokens):
                tok = ahead.pop(0) if ahead else draw(-1)
                started = False
                # a step runs from its token being known to the next one's: a GPU decodes after llama_decode
                # returns, so the wait for a one-token step's own decode falls in that step, not the next
                top = time.perf_counter()
                if spec and step and not ahead:  # a step ends when its tokens are handed out, UI included
                    if step[0] > gen.first_token_at:  # not the first: after a prefill llama.cpp builds its graph
                        spec.record_step(top - step[0], step[1], step[2])  # before the next draft: it plans by it
                    step = None
                evaluated = bool(ahead)  # a kept draft token; the last one drawn is pending like any
                _stamp(gen, i, top)
                self.tokens.append(tok)
                gen.tokens.append(tok)
                if self.is_eog(tok):
                    gen.stop_reason = "eog"
                    return
                room = self.n_ctx - self.n_kv - 2
                steps = not (evaluated or inject or i == max_tokens - 1 or room < 0)
                if steps and self.overlaps and i:  # not the first: the step after a prefill builds a graph
                    # the next evaluation starts before the text is handed out: a GPU computes while the UI draws
                    ahead, step = self._step(tok, draw, spec, min(room, max_tokens - 2 - i), top)
                    started = True
                text = decoder.decode(self.piece(tok))  # after the evaluation's start: a GPU is not kept waiting
                if text:
                    yield text
                if i == max_tokens - 1:
                    gen.stop_reason = "max_tokens"
                    return
                if cancelled and cancelled():
                    gen.stop_reason = "cancelled"
                    return
                if evaluated or started:
                    continue
                if steps and spec:  # on the CPU (and after a GPU's first token) the text goes first
                    ahead, step = self._step(tok, draw, spec, min(room, max_tokens - 2 - i), top)
                    continue
                step = (top, 1, 0)
                if (yield from self._evaluate_one(tok, inject, room, gen, decoder)):
                    return
            gen.stop_reason = gen.stop_reason or "max_tokens"
        finally:
            self._end_reply(started)

    def draw_with(self, sampler: object) -> bool:
        """The draw in llama.cpp's graph attached where `sampler` is the greedy one alone, else detached: whether
        the next evaluation draws there. Said before a prompt's evaluation, a reply whose draw differs from the
        last one's costs no evaluation again (33 ms on an 8B on the H100, its graph made again)."""
        gd = self.graph_draw
        if gd is None:
            return False
        if not isinstance(sampler, Constrained) and is_greedy(sampler) and gd.attach(SEQ):
            return True
        gd.detach(SEQ)
        return False

    def _drawer(self, sampler: object) -> Callable[[int], int]:
        """The reply's draw: a greedy one in the graph where it can be (attached for the reply's next
        evaluation on), any other from the logits on the host (the last output evaluated again where its
        token was drawn in the graph and its logits not kept)."""
        host = drawer(sampler, self.ctx, self.vocab)
        gd = self.graph_draw
        if gd is not None and self.draw_with(sampler):
            return lambda i: gd.token(i) if self.drawn_in_graph else host(i)
        if self.drawn_in_graph and self.logits_end == self.n_kv > 0:
            last = self.n_kv - 1
            self.forget_from(last)
            self._decode([self.tokens[last]], last, want_logits=True)
        return host

    def check_finite(self) -> None:
        """One token evaluated once per load, before any chat: a file whose weights give NaN or infinite
        logits would write nonsense; say so instead. The KV is left empty."""
        bos = lc.llama_vocab_bos(self.vocab)
        self._decode([bos if bos >= 0 else 0], 0, want_logits=True)
        finite = finite_logits(self.ctx, self.vocab)
        self.clear()
        if not finite:
            name = self.config.model_path.rsplit("/", 1)[-1]
            raise DamagedModel(f"{name}: the model file produced non-finite values (NaN or infinite logits): the "
                               "file is damaged, or this llama.cpp mishandles its quantization; re-download it or "
                               "try another quantization")

    def warm_up(self) -> None:
        """Where every layer is on a GPU, one batch and one step evaluated and dropped, once at load: CUDA loads a
        kernel at its first use, which would fall into the first turn's time (llama-server warms up alike). Not on a
        CPU (nothing to load) nor with layers on it (their share of the batch would add seconds to the start). The
        KV is left empty."""
        if not self.queues:
            return
        word = self.tokenize("warm", False, False) or [0]
        self.prefill((word * WARM_UP_TOKENS)[:min(WARM_UP_TOKENS, self.config.n_batch, self.n_ctx - 2)])
        self.prefill(self.tokens + word)
        self.synchronize()
        self.clear()

    def _evaluate_one(self, tok: int, inject: Callable[[], list[int]] | None, room: int, gen: Generation,
                      decoder: codecs.IncrementalDecoder) -> Generator[str, None, bool]:
        """Evaluate the token just handed out and what `inject` says must follow it (its text yielded);
        True when the context has no room for them."""
        forced = inject() if inject else []  # after the text is handed out: it follows what was shown
        if room - len(forced) < 0:
            gen.stop_reason = "context_full"
            return True
        self._decode([tok, *forced], self.n_kv, want_logits=True)
        self.n_kv += 1 + len(forced)
        if forced:
            self.tokens.extend(forced)
            gen.tokens.extend(forced)
            text = decoder.decode(b"".join(self.piece(t) for t in forced))
            if text:
                yield text
        return False

    def _end_reply(self, started: bool) -> None:
        if started:
            self.synchronize()  # the evaluation begun for the last token ends before anyone touches the KV
        if self.n_kv > len(self.tokens):  # stopped with kept draft tokens not handed out: not in the reply
            self.forget_from(len(self.tokens))
            self.n_kv = len(self.tokens)

    def _step(self, tok: int, draw: Callable[[int], int], spec: Speculation | None, room: int,
              top: float) -> tuple[list[int], tuple[float, int, int]]:
        """Evaluate `tok`, with a draft where one pays (verified at once): the tokens a verification drew
        ahead, and the step in flight (its start, the tokens it hands out, the draft's length)."""
        draft = spec.draft(self.tokens, room) if spec else []
        if spec and draft:
            ahead = verify(self, draw, tok, draft, spec)
            spec.learn(self.tokens)
            return ahead, (top, len(ahead), len(draft))
        self._decode([tok], self.n_kv, want_logits=True)
        self.n_kv += 1
        if spec:
            spec.learn(self.tokens)
        return [], (top, 1, 0)

    # ------------------------------------------------------------------ counters and state
    def perf(self) -> dict[str, float]:
        """llama.cpp's counters since `reset_perf`; prompt tokens less the batches' padding (no history)."""
        p = lc.llama_perf_context(self.ctx)
        return {"prompt_ms": p.t_p_eval_ms, "prompt_n": p.n_p_eval - self.padded, "eval_ms": p.t_eval_ms,
                "eval_n": p.n_eval, "padding_n": self.padded}

    def reset_perf(self) -> None:
        lc.llama_synchronize(self.ctx)  # queued batches are booked before the counters start again
        lc.llama_perf_context_reset(self.ctx)
        self.padded = 0

    def state_bytes(self, seq: int = SEQ) -> memoryview:
        """Copy a sequence's KV (the working one's evaluated tokens, or a parked one) out of llama.cpp: one
        copy, no more; through the pinned buffer where it is free (then `state_done` once the copy is written)."""
        size = lc.llama_state_seq_get_size(self.ctx, seq)
        pinned = self.staging.lend(size) if self.staging is not None else None
        if pinned is not None:
            written = lc.llama_state_seq_get_data(self.ctx, pinned.array, size, seq)
            return pinned.view(written)
        data = bytearray(size)
        written = lc.llama_state_seq_get_data(self.ctx, (ctypes.c_uint8 * size).from_buffer(data), size, seq)
        return memoryview(data)[:written]

    def staged(self, size: int) -> memoryview | None:
        """The pinned buffer's first `size` bytes, lent to read a state into for `load_state` (then
        `state_done`); None where there is none free."""
        pinned = self.staging.lend(size) if self.staging is not None else None
        return pinned.view(size) if pinned is not None else None

    def state_done(self, data: memoryview | bytes | bytearray) -> None:
        """A state copy is written or loaded: the pinned buffer it may hold is free again."""
        if self.staging is not None and isinstance(data, memoryview) and self.staging.owns(data):
            self.staging.give_back()

    def load_state(self, data: bytes | bytearray | memoryview, tokens: list[int]) -> bool:
        """Restore a KV copied by state_bytes; the caller has verified it belongs here."""
        self._clear_kv()
        self.tokens, self.n_kv, self.logits_end = [], 0, -1
        if not self._set_state(memoryview(data), SEQ):
            self._clear_kv()
            return False
        return self._loaded(tokens)

    def load_chain(self, parts: Iterable[tuple[int, memoryview]], tokens: list[int]) -> bool:
        """Restore a base state and the segments saved after it (each the cells from its cut on, as
        session/kvdelta cuts them), each laid into the KV by llama.cpp as it comes (`parts` may check each part
        as it is asked for): a segment's cells go to the spare sequence, the working one's from the cut on are
        dropped, and the segment's cells join it (a unified KV: its cells are shared, nothing is copied). False
        where llama.cpp refuses a part or the spare sequence is taken; where `parts` raises, the KV is left empty."""
        spare = self.sequences - 1
        self._clear_kv()
        self.tokens, self.n_kv, self.logits_end = [], 0, -1
        if spare < 1 or lc.llama_memory_seq_pos_max(self.mem, spare) >= 0:
            return False
        loaded = False
        try:
            loaded = self._chain_in(parts, spare) and lc.llama_memory_seq_pos_min(self.mem, SEQ) in (0, -1) and \
                self._loaded(tokens)
        finally:
            if not loaded:  # a part refused or found damaged: no cells of the chain stay
                lc.llama_memory_seq_rm(self.mem, spare, -1, -1)
                self._clear_kv()
        return loaded

    def _chain_in(self, parts: Iterable[tuple[int, memoryview]], spare: int) -> bool:
        for i, (cut, data) in enumerate(parts):
            if i and not lc.llama_memory_seq_rm(self.mem, SEQ, cut, -1):  # a chain's positions are its tokens'
                return False
            if not self._set_state(data, SEQ if i == 0 else spare):
                return False
            if i:
                lc.llama_memory_seq_cp(self.mem, spare, SEQ, -1, -1)
                lc.llama_memory_seq_rm(self.mem, spare, -1, -1)
        return True

    def _set_state(self, view: memoryview, seq: int) -> bool:
        """One sequence state into sequence `seq` (llama.cpp drops what it held first); False where refused."""
        view = view.cast("B") if view.format != "B" else view
        buf = (ctypes.c_uint8 * len(view)).from_buffer_copy(view) if view.readonly else \
            (ctypes.c_uint8 * len(view)).from_buffer(view)  # the pinned buffer's own pages: copied to the card directly
        loaded = lc.llama_state_seq_set_data(self.ctx, buf, len(view), seq)
        while loaded == 0 and self._room_made(1):  # parked sequences hold the cells it needs
            loaded = lc.llama_state_seq_set_data(self.ctx, buf, len(view), seq)
        return loaded != 0

    def _loaded(self, tokens: list[int]) -> bool:
        """After a state is loaded: the history is `tokens` where the KV ends at their last position."""
        placed = self._positions_from(tokens)
        if not placed or lc.llama_memory_seq_pos_max(self.mem, SEQ) != self.positions.at(len(tokens) - 1):
            self._clear_kv()
            return False
        self.tokens, self.n_kv = list(tokens), len(tokens)
        return True

    def _positions_from(self, tokens: list[int]) -> bool:
        """The M-RoPE chunks among a loaded state's tokens, placed as when they were evaluated; False where a
        chunk's embeddings (which say its placement) are neither in memory nor in the disk cache."""
        if not self.mrope or not tokens or min(tokens) >= 0:
            return True
        at = 0
        while at < len(tokens):
            end = _segment_end(tokens, at)
            if tokens[at] < 0:
                try:
                    emb = self.media.get(run_of(tokens[at])[0])
                except DocumentError:
                    return False
                if emb.nx and end - at != emb.n:  # a chunk in part: not a state this engine saved
                    return False
                if emb.nx:
                    self.positions.record(at, end, emb.n_pos)
            at = end
        return True

    def close(self) -> None:
        staging, self.staging = getattr(self, "staging", None), None
        if staging is not None:
            staging.close()
        if getattr(self, "ctx", None):
            lc.llama_batch_free(self._batch)
            if self._embd_batch is not None:
                lc.llama_batch_free(self._embd_batch)
            lc.llama_free(self.ctx)
            if self.graph_draw is not None:
                self.graph_draw.free()
            lc.llama_model_free(self.model)
            self.ctx = None


def _parks(model: object) -> bool:
    """Whether a sequence parks whole in this model's KV (a sliding window's or a recurrent state's would need a
    share of their own each)."""
    return not (lc.llama_model_n_swa(model) or lc.llama_model_is_recurrent(model) or lc.llama_model_is_hybrid(model))


def _offloaded(config: EngineConfig, model: object) -> tuple[bool, bool]:
    """(overlaps, queues). A GPU computes after llama_decode returns: the next token's evaluation can start before
    the text is handed out (on the CPU llama_decode returns when it is done, so the text goes first). Where every
    layer and the output are on it, the call returns with the whole batch queued (with layers on the CPU, once their
    part is computed)."""
    overlaps = config.n_gpu_layers != 0 and bool(lc.llama_supports_gpu_offload())
    return overlaps, overlaps and not 0 <= config.n_gpu_layers <= lc.llama_model_n_layer(model)


def _stamp(gen: Generation, i: int, at: float) -> None:
    """When reply token i was drawn: the first, the second (the first step's end) and the last."""
    gen.last_token_at = at
    if i == 0:
        gen.first_token_at = at
        TRACE.stamp("first_token")
    elif i == 1:
        gen.second_token_at = at


def _continues(tokens: list[int], i: int) -> bool:
    """Whether tokens[i] is the next row of the image run tokens[i - 1] belongs to."""
    if tokens[i] >= 0 or tokens[i - 1] >= 0:
        return False
    run, row = run_of(tokens[i - 1])
    return run_of(tokens[i]) == (run, row + 1)


def _segment_end(tokens: list[int], at: int) -> int:
    """The end of the text run, or of the consecutive rows of one image run, that starts at `at`."""
    end = at + 1
    if tokens[at] >= 0:
        while end < len(tokens) and tokens[end] >= 0:
            end += 1
    else:
        while end < len(tokens) and _continues(tokens, end):
            end += 1
    return end
