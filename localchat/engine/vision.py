"""A vision projector beside the model (libmtmd): an image's pixels split into text and image chunks as
the projector lays them out, each image chunk encoded once and kept by its identity tokens
(`engine.media`), in memory and in the disk cache, so that an image seen before costs no encoding,
not even the split: its layout is cached with its embeddings."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as lc

try:
    import llama_cpp.mtmd_cpp as M
except (OSError, RuntimeError):  # a llama-cpp-python without a loadable libmtmd chats; only images need it
    M = None  # type: ignore[assignment]

from localchat import paths
from localchat.engine import media
from localchat.engine.backend import log_callback
from localchat.engine.context import Engine
from localchat.engine.media import Embedding
from localchat.errors import DocumentError, ModelError
from localchat.fsutil import file_sha256

log = logging.getLogger(__name__)
LAYOUT_FORMAT = 1


@dataclass(frozen=True)
class ImageTokens:
    tokens: list[int]  # the image as the message holds it: the projector's text around it and identity tokens
    image_tokens: int  # of them, the image's own positions
    encoded: int  # image tokens the encoder computed now (0: all from the cache)
    key: int  # the image's key (its bytes and this projector): its cache file, its identity tokens
    width: int
    height: int


def fingerprint(path: Path) -> str:
    """The projector's identity for cache keys: the sha256 of its whole content (two fine-tunes may differ only in
    the middle), read once per file identity."""
    return file_sha256(path, paths.digests_file()).removeprefix("sha256:")


class Projector:
    """libmtmd's context for one projector file, bound to the engine's model."""

    def __init__(self, path: Path, engine: Engine, model_name: str, cap: tuple[int, int] = (0, 0)):
        """`cap`: the least and most tokens of an image whose positions see each other (evaluated in one batch),
        where the projector sizes images to a budget larger than the batch (0, 0: its own budget); opened with it,
        and again without where libmtmd says this model's images are causal after all (one load, not two)."""
        self.path, self.engine, self.name = path, engine, path.name
        if M is None:
            raise ModelError(f"{path.name} cannot be used: this llama-cpp-python was built without libmtmd "
                             "(LLAVA_BUILD off), which images need")
        M.mtmd_log_set(log_callback(), None)
        M.mtmd_helper_log_set(log_callback(), None)
        self.ctx = self._open(model_name, cap)  # libmtmd sizes each image within the batch, not the attach refusing it
        if not M.mtmd_support_vision(self.ctx):
            self.close()
            raise ModelError(f"{path.name} has no vision encoder (an audio projector?); images need a vision one")
        capped = bool(cap[1]) and bool(M.mtmd_decode_use_non_causal(self.ctx, None))
        if cap[1] and not capped:  # its images are causal: the projector's own budget
            self.close()
            self.ctx = self._open(model_name)
        self.mrope = bool(M.mtmd_decode_use_mrope(self.ctx))  # libmtmd's placement, from the text model
        # an image's layout and encoding depend on the budget too: the cache keeps each budget's apart
        self._budget = f":{cap[0]}-{cap[1]}" if capped else ""
        self.n_vocab = lc.llama_vocab_n_tokens(engine.vocab)

    @functools.cached_property
    def fingerprint(self) -> str:
        """Read at the first image (a text-only chat never reads a large projector whole), then known by identity."""
        return fingerprint(self.path) + self._budget

    def _open(self, model_name: str, cap: tuple[int, int] = (0, 0)) -> object:
        params = M.mtmd_context_params_default()
        params.use_gpu = self.engine.overlaps
        params.n_threads = self.engine.threads[1]
        params.print_timings = False
        params.warmup = False  # an encode at load would hold up every chat start (the plan counts its buffers)
        if cap[1]:
            params.image_min_tokens, params.image_max_tokens = cap
        ctx = M.mtmd_init_from_file(str(self.path).encode(), self.engine.model, params)
        if not ctx:
            raise ModelError(f"{self.name} is not a vision projector for {model_name} (its output does not match the "
                             "model's width, or the file is damaged): use the mmproj file made with this model")
        return ctx

    def key(self, image_sha256: str) -> int:
        return int(hashlib.sha256(f"{self.fingerprint}:{image_sha256}".encode()).hexdigest()[:16], 16) % \
            (1 << media.KEY_BITS)

    def cached(self, key: int, image_sha256: str) -> ImageTokens | None:
        """The image's tokens from the disk cache, with its embeddings put in the engine's table; None where it
        is not there, is another image's or projector's, or does not hold together."""
        directory = self.engine.media.directory
        found = media.load(media.cache_file(directory, key)) if directory is not None else None
        if found is None:
            return None
        header, runs = found
        about = (header.get("format"), header.get("projector"), header.get("image"), header.get("n_embd"))
        if about != (LAYOUT_FORMAT, self.fingerprint, image_sha256, self.engine.media.n_embd) or \
                not self.engine.media.places(runs):  # encoded beside a model of the other placement: again
            return None
        try:
            tokens = _layout_tokens(header["layout"], runs, self.n_vocab)
            found_tokens = ImageTokens(tokens, sum(e.n for e in runs.values()), 0, key, int(header["width"]),
                                       int(header["height"]))
        except (KeyError, TypeError, ValueError):
            return None
        self._check_fits(runs)
        self.engine.media.add(runs)
        return found_tokens

    def encode(self, rgb: bytes, width: int, height: int, image_sha256: str) -> ImageTokens:
        """The image's tokens, split and encoded (and cached): `cached` first finds one seen before."""
        key = self.key(image_sha256)
        bitmap = M.mtmd_bitmap_init(width, height, (ctypes.c_uint8 * len(rgb)).from_buffer_copy(rgb))
        chunks = M.mtmd_input_chunks_init()
        try:
            layout, runs = self._split(bitmap, chunks, key)
        finally:
            M.mtmd_input_chunks_free(chunks)
            M.mtmd_bitmap_free(bitmap)
        self._check_fits(runs)
        self.engine.media.add(runs)
        if self.engine.media.directory is not None:
            about = {"format": LAYOUT_FORMAT, "projector": self.fingerprint, "image": image_sha256,
                     "n_embd": self.engine.media.n_embd, "width": width, "height": height}
            try:
                media.save(media.cache_file(self.engine.media.directory, key), layout, runs, about)
            except OSError as exc:  # a full disk: the image is still attached, only not cached for the next chat
                log.info("the image cache could not keep an image: %s", exc)
        n = sum(e.n for e in runs.values())
        return ImageTokens(_layout_tokens(layout, runs, self.n_vocab), n, n, key, width, height)

    def _check_fits(self, runs: dict[int, Embedding]) -> None:
        """A chunk whose positions see each other is evaluated in one batch: refused here, at attach time, where
        this context's batch is smaller (a causal one is evaluated in pieces)."""
        ubatch = min(self.engine.config.n_ubatch, self.engine.config.n_batch)
        widest = max((e.n for e in runs.values() if e.non_causal), default=0)
        if widest > ubatch:
            raise DocumentError(f"the image is {widest} positions that see each other, evaluated in one batch, and "
                                f"n_ubatch is {ubatch}: raise n_ubatch and n_batch to at least {widest}")

    def _split(self, bitmap: int, chunks: int, key: int) -> tuple[list[dict], dict[int, Embedding]]:
        """The projector's chunks of the image: text parts as tokens, image parts encoded."""
        marker = M.mtmd_default_marker()
        text = M.mtmd_input_text(marker, len(marker), False, True)
        rc = M.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), (M.mtmd_bitmap_p_ctypes * 1)(bitmap), 1)
        if rc != 0:
            raise DocumentError(f"the projector {self.name} could not prepare the image (code {rc})")
        layout: list[dict] = []
        runs: dict[int, Embedding] = {}
        for i in range(M.mtmd_input_chunks_size(chunks)):
            chunk = M.mtmd_input_chunks_get(chunks, i)
            if M.mtmd_input_chunk_get_type(chunk) == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                count = ctypes.c_size_t()
                ptr = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
                tokens = [ptr[j] for j in range(count.value)]
                if any(t < 0 or t >= self.n_vocab for t in tokens):  # its image markers are not in this vocabulary
                    raise DocumentError(f"the projector {self.name} marks images with tokens this model's vocabulary "
                                        "lacks: it was made for another model")
                layout.append({"text": tokens})
            else:
                run = media.run_id(key, len(runs))
                runs[run] = self._encode_chunk(chunk)
                layout.append({"run": run, "n": runs[run].n})
        return layout, runs

    def _encode_chunk(self, chunk: int) -> Embedding:
        n = M.mtmd_input_chunk_get_n_tokens(chunk)
        if M.mtmd_encode_chunk(self.ctx, chunk) != 0:
            raise DocumentError(f"the projector {self.name} failed to encode the image")
        size = n * self.engine.media.n_embd * 4
        data = ctypes.string_at(M.mtmd_get_output_embd(self.ctx), size)
        non_causal = bool(M.mtmd_decode_use_non_causal(self.ctx, chunk))
        if not self.mrope:
            return Embedding(data, n, non_causal)
        image = M.mtmd_input_chunk_get_tokens_image(chunk)
        nx, ny = M.mtmd_image_tokens_get_nx(image), M.mtmd_image_tokens_get_ny(image)
        n_pos = M.mtmd_input_chunk_get_n_pos(chunk)
        if nx * ny != n or not media.placed(n, nx, n_pos):  # a grid of nx x ny rows, as Qwen-VL's
            raise DocumentError(f"the projector {self.name} laid the image out in a grid localchat cannot place")
        return Embedding(data, n, non_causal, nx, n_pos)

    def close(self) -> None:
        if getattr(self, "ctx", None):
            M.mtmd_free(self.ctx)
            self.ctx = None


def _layout_tokens(layout: list[dict], runs: dict[int, Embedding], n_vocab: int) -> list[int]:
    """The image's tokens from its layout: text parts as they are, each image part its run's identity tokens."""
    tokens: list[int] = []
    for part in layout:
        if "text" in part:
            text = [int(t) for t in part["text"]]
            if not all(0 <= t < n_vocab for t in text):
                raise ValueError("a layout's text outside the vocabulary")
            tokens += text
        else:
            run = int(part["run"])
            if run not in runs or runs[run].n != int(part["n"]):
                raise ValueError("a layout's run without its embeddings")
            tokens += media.identity_tokens(run, runs[run].n)
    return tokens
