"""Sentence embeddings from an embedding GGUF (all-MiniLM, nomic-embed, bge, ...) through the same
llama.cpp as the chat: one context with embeddings on, several texts a batch (one sequence each),
pooled as the model says (mean, CLS, last) and normalized, so a dot product is their cosine."""

from __future__ import annotations

import ctypes
import os
import threading

import llama_cpp as lc
import numpy as np

from localchat.engine.backend import init_backend, model_params
from localchat.engine.loadlog import LOAD_LOG, explain
from localchat.engine.types import EngineConfig
from localchat.engine.vocab import VocabText
from localchat.errors import ModelError

MAX_WINDOW = 512  # tokens of a text that are embedded (what the small embedding models were trained on)
MAX_SEQUENCES = 16  # texts evaluated in one batch
_POOLED = {lc.LLAMA_POOLING_TYPE_MEAN: "mean", lc.LLAMA_POOLING_TYPE_CLS: "cls", lc.LLAMA_POOLING_TYPE_LAST: "last"}


def identity(path: str) -> str:
    """An embedding model's name for the vectors it made: the file's name and size (another file, other vectors)."""
    return f"{os.path.basename(path)}:{os.path.getsize(path)}"


class Embedder(VocabText):
    """One embedding model; `vectors` may be called from any thread (one at a time)."""

    def __init__(self, path: str, threads: int = 1):
        init_backend(False)
        LOAD_LOG.start()
        try:
            self.model = lc.llama_model_load_from_file(path.encode(), model_params(EngineConfig(path, n_gpu_layers=0)))
        finally:
            LOAD_LOG.stop()
        if not self.model:
            raise ModelError(explain(path, LOAD_LOG.reason()))
        self.vocab = lc.llama_model_get_vocab(self.model)
        self._piece_buf = ctypes.create_string_buffer(256)
        self.window = min(MAX_WINDOW, lc.llama_model_n_ctx_train(self.model) or MAX_WINDOW)
        self.ctx = lc.llama_init_from_model(self.model, self._params(threads))
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise ModelError(f"{path}: llama.cpp could not create an embedding context")
        self.pooling = _POOLED.get(lc.llama_pooling_type(self.ctx), "")
        if not self.pooling:
            self.close()
            raise ModelError(f"{path}: not an embedding model (it pools no sentence vector); "
                             "give an embedding GGUF such as all-MiniLM-L6-v2, nomic-embed-text or bge")
        self.dim = lc.llama_model_n_embd(self.model)
        self.name = identity(path)
        self._encoder_only = lc.llama_model_has_encoder(self.model) and not lc.llama_model_has_decoder(self.model)
        self._batch = lc.llama_batch_init(self.window * 2, 0, 1)
        self._lock = threading.Lock()

    def _params(self, threads: int) -> lc.llama_context_params:
        params = lc.llama_context_default_params()
        params.embeddings = True
        params.n_ctx = self.window * 2
        params.n_batch = params.n_ubatch = self.window * 2  # a non-causal model sees each text in one ubatch
        params.n_seq_max = MAX_SEQUENCES
        params.kv_unified = True  # a causal embedding model's texts share the one window, not a 16th each
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        return params

    def close(self) -> None:
        if getattr(self, "ctx", None):
            lc.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            lc.llama_model_free(self.model)
            self.model = None

    def vectors(self, texts: list[str]) -> np.ndarray:
        """One unit-length float32 row per text (its first `window` tokens)."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        with self._lock:
            group: list[tuple[int, list[int]]] = []
            for i, text in enumerate(texts):
                tokens = self.tokenize(text, special=False, add_bos=True)[:self.window] or [0]
                if group and (len(group) == MAX_SEQUENCES
                              or sum(len(t) for _, t in group) + len(tokens) > self.window * 2):
                    self._evaluate(group, out)
                    group = []
                group.append((i, tokens))
            if group:
                self._evaluate(group, out)
        return out

    def _evaluate(self, group: list[tuple[int, list[int]]], out: np.ndarray) -> None:
        batch = self._batch
        n = 0
        for seq, (_, tokens) in enumerate(group):
            for pos, token in enumerate(tokens):
                batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.logits[n] = token, pos, 1, True
                batch.seq_id[n][0] = seq
                n += 1
        batch.n_tokens = n
        memory = lc.llama_get_memory(self.ctx)
        if memory:
            lc.llama_memory_clear(memory, True)
        status = (lc.llama_encode if self._encoder_only else lc.llama_decode)(self.ctx, batch)
        if status != 0:
            raise ModelError(f"llama.cpp could not embed a text (status {status})")
        for seq, (row, _) in enumerate(group):
            vector = np.ctypeslib.as_array(lc.llama_get_embeddings_seq(self.ctx, seq), shape=(self.dim,))
            norm = float(np.linalg.norm(vector))
            out[row] = vector / norm if norm > 0 else vector


class LazyEmbedder:
    """An Embedder loaded on its first use, by the thread that first needs it (off the chat's start)."""

    def __init__(self, path: str, threads: int = 1):
        self.path, self.threads, self.name = path, threads, identity(path)
        self._loaded: Embedder | None = None
        self._lock = threading.Lock()

    def vectors(self, texts: list[str]) -> np.ndarray:
        with self._lock:
            self._loaded = self._loaded or Embedder(self.path, self.threads)
        return self._loaded.vectors(texts)
