"""A model's vocabulary and metadata as text: tokens to text and back, the GGUF's metadata values."""

from __future__ import annotations

import ctypes
import hashlib

import llama_cpp as lc

from localchat.errors import ModelError


class VocabText:
    """Mixed into the Engine, which sets `model`, `vocab` and `_piece_buf`."""

    model: object
    vocab: object
    _piece_buf: ctypes.Array
    _signature: str | None = None

    def tokenize(self, text: str, special: bool, add_bos: bool = False) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, add_bos, special)
        if n < 0:
            cap = -n
            buf = (lc.llama_token * cap)()
            n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, add_bos, special)
        return list(buf[:n])

    def piece(self, token: int, special: bool = False) -> bytes:
        if token < 0:  # an image's identity token (engine.media): no text
            return b""
        n = lc.llama_token_to_piece(self.vocab, token, self._piece_buf, 256, 0, special)
        if n < 0:
            big = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self.vocab, token, big, -n, 0, special)
            return big.raw[:n]
        return self._piece_buf.raw[:n]

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        return b"".join(self.piece(t, special) for t in tokens).decode("utf-8", errors="replace")

    def signature(self) -> str:
        """Which vocabulary this is, cheaply: its size and a hash of a spread of its pieces (token ids mean
        the same text only under the same one)."""
        if self._signature is None:
            n = lc.llama_vocab_n_tokens(self.vocab)
            h = hashlib.sha256(str(n).encode())
            spread = range(0, n, max(1, n // 1024))
            for t in [*spread, *range(max(0, n - 256), n)]:  # the tail too: added special tokens go there
                h.update(self.piece(t, special=True) + b"\0")
            self._signature = f"{n}:{h.hexdigest()[:16]}"
        return self._signature

    def is_eog(self, token: int) -> bool:
        return bool(lc.llama_vocab_is_eog(self.vocab, token))

    @property
    def add_bos(self) -> bool:
        return bool(lc.llama_vocab_get_add_bos(self.vocab))

    def meta_bytes(self, key: str) -> bytes | None:
        """A metadata value as the GGUF stores it (a chat template may be long or not UTF-8)."""
        size = 1 << 16
        while True:
            buf = ctypes.create_string_buffer(size)
            n = lc.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
            if n < 0:
                return None
            if n < size:
                return buf.raw[:n]
            size = n + 1

    def meta(self, key: str) -> str | None:
        raw = self.meta_bytes(key)
        return None if raw is None else raw.decode("utf-8", errors="replace")

    def special_text(self, which: str) -> str:
        tok = {"bos": lc.llama_vocab_bos, "eos": lc.llama_vocab_eos}[which](self.vocab)
        return self.piece(tok, special=True).decode("utf-8", errors="replace") if tok >= 0 else ""


class Tokenizer(VocabText):
    """A model's vocabulary alone (llama.cpp's vocab_only: no weights, no context), to count tokens."""

    def __init__(self, path: str):
        from localchat.engine.backend import init_backend
        init_backend(False)
        params = lc.llama_model_default_params()
        params.vocab_only = True
        self.model = lc.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise ModelError(f"{path}: llama.cpp cannot read its vocabulary")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self._piece_buf = ctypes.create_string_buffer(256)

    def close(self) -> None:
        lc.llama_model_free(self.model)
