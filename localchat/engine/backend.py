"""llama.cpp's process-wide side: backend start-up, its log, the KV types, what this build can do."""

from __future__ import annotations

import ctypes
import logging
import re

import llama_cpp as lc

log = logging.getLogger("localchat.engine")

SEQ = 0
KV_TYPES = {"f32": lc.GGML_TYPE_F32, "f16": lc.GGML_TYPE_F16, "bf16": 30,
            "q8_0": lc.GGML_TYPE_Q8_0, "q4_0": lc.GGML_TYPE_Q4_0, "q4_1": lc.GGML_TYPE_Q4_1,
            "q5_0": lc.GGML_TYPE_Q5_0, "q5_1": lc.GGML_TYPE_Q5_1, "iq4_nl": lc.GGML_TYPE_IQ4_NL}

_LOG_CALLBACK = None  # keeps the ctypes callback alive for the process


def llama_version() -> str:
    return lc.__version__


def gpu_offload_supported() -> bool:
    return bool(lc.llama_supports_gpu_offload())


def init_backend(verbose: bool) -> None:
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        lc.llama_backend_init()

        @lc.llama_log_callback
        def _cb(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
            if text and b"KV buffer size" in text:
                _KV_LOG.append(text.decode("utf-8", errors="replace"))
            if _VERBOSE[0] and text:
                log.debug(text.decode("utf-8", errors="replace").rstrip("\n"))

        _LOG_CALLBACK = _cb
        lc.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
    _VERBOSE[0] = verbose


_VERBOSE = [False]
_KV_LOG: list[str] = []  # llama.cpp's "KV buffer size" lines: what it really allocated
_KV_LINE = re.compile(r"(\S+) KV buffer size =\s*([\d.]+) MiB")


def start_kv_log() -> None:
    """Forget the KV buffers logged so far: the next context's are read by kv_buffers()."""
    _KV_LOG.clear()


def kv_buffers() -> dict[str, int]:
    """Buffer name (CPU, CUDA0) -> KV bytes llama.cpp allocated since start_kv_log()."""
    found: dict[str, int] = {}
    for line in _KV_LOG:
        if m := _KV_LINE.search(line):
            found[m[1]] = found.get(m[1], 0) + round(float(m[2]) * (1 << 20))
    return found


def cpu_has_amx() -> bool:
    """ggml's AMX kernels die with SIGILL where the CPU reports AMX but the VM does not enable it
    (seen on our CI machines), so AMX (and the other CPU repack buffers) stay off there."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False
