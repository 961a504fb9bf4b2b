"""llama.cpp's process-wide side: backend start-up, its log, the KV types, what this build can do."""

from __future__ import annotations

import ctypes
import logging
import re
from pathlib import Path

import llama_cpp as lc

from localchat.engine.loadlog import LOAD_LOG
from localchat.engine.speculative import DRAFT_MAX
from localchat.engine.types import Device, EngineConfig

log = logging.getLogger("localchat.engine")

SEQ = 0
# a KV cache type by name -> ggml's number for it
GGML_TYPES = {"f32": lc.GGML_TYPE_F32, "f16": lc.GGML_TYPE_F16, "bf16": 30,
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
            if text and b"buffer size" in text:
                _BUFFER_LOG.append(text.decode("utf-8", errors="replace"))
            if text and LOAD_LOG.active:
                LOAD_LOG.feed(text.decode("utf-8", errors="replace"))
            if _VERBOSE[0] and text:
                log.debug(text.decode("utf-8", errors="replace").rstrip("\n"))

        _LOG_CALLBACK = _cb
        lc.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
    _VERBOSE[0] = verbose


def log_callback() -> object:
    """The callback llama.cpp's log goes through (libmtmd's too): quiet unless --verbose."""
    return _LOG_CALLBACK


_VERBOSE = [False]
_BUFFER_LOG: list[str] = []  # llama.cpp's "... buffer size = N MiB" lines: what it really allocated
_BUFFER_LINE = re.compile(r"(\S+)\s+(model|KV|compute|output|RS) buffer size =\s*([\d.]+) MiB")


def start_buffer_log() -> None:
    """Forget the buffers logged so far: the next model's and context's are read by buffers()."""
    _BUFFER_LOG.clear()


def buffers() -> dict[str, dict[str, int]]:
    """Kind (model, KV, compute, output) -> buffer (CPU, CUDA0, CUDA_Host) -> bytes llama.cpp allocated
    since start_buffer_log(), as its log reports them (to 0.01 MiB)."""
    found: dict[str, dict[str, int]] = {}
    for line in _BUFFER_LOG:
        if m := _BUFFER_LINE.search(line):
            per = found.setdefault(m[2], {})
            per[m[1]] = per.get(m[1], 0) + round(float(m[3]) * (1 << 20))
    return found


# ---------------------------------------------------------------- the CPU's compute threads
OMP_PAUSE_SOFT = 1  # OpenMP 5.0's omp_pause_soft: a thread's team released, to be made again at its next use


def _openmp() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime llama.cpp's CPU backend runs its threads on, where it is loaded (Linux builds)."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            paths = sorted({line.split(None, 5)[-1].strip() for line in maps if "libgomp" in line})  # its path field
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            lib.omp_pause_resource_all.restype = ctypes.c_int
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            return lib
    return None


def release_compute_threads() -> bool:
    """Let go of the OpenMP team the calling thread started with its llama.cpp calls, where it hands the engine to
    another thread: libgomp counts every team's threads, and once they outnumber the CPUs (a second team of as many
    threads as cores) every barrier of every graph waits in the kernel after 100 spins (the terminal UI decoded at
    0.79x line mode on the 2-core VM, 240 sleeps a token). False where no GNU OpenMP runtime is loaded."""
    lib = _openmp()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


# ---------------------------------------------------------------- devices (ggml's registry)
_DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}


def _ggml() -> ctypes.CDLL:
    """The ggml library llama.cpp is linked against (already loaded with it)."""
    lib = ctypes.CDLL(str(Path(lc.llama_cpp._lib._name).parent / "libggml.so"))
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_name.restype = ctypes.c_char_p
    lib.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_description.restype = ctypes.c_char_p
    lib.ggml_backend_dev_description.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)]
    lib.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    lib.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.ggml_backend_register.argtypes = [ctypes.c_void_p]
    return lib


def devices() -> list[Device]:
    """Every device llama.cpp can use, with its free and total memory now (cudaMemGetInfo for a GPU)."""
    init_backend(_VERBOSE[0])
    try:
        lib = _ggml()
    except OSError:
        return []
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append(Device(lib.ggml_backend_dev_name(dev).decode(errors="replace"),
                          (lib.ggml_backend_dev_description(dev) or b"").decode(errors="replace"),
                          _DEVICE_TYPES.get(lib.ggml_backend_dev_type(dev), "other"), free.value, total.value))
    return out


def cpu_has_amx() -> bool:
    """ggml's AMX kernels die with SIGILL where the CPU reports AMX but the VM does not enable it
    (seen on our CI machines), so AMX (and the other CPU repack buffers) stay off there."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


def rpc_supported() -> bool:
    return bool(lc.llama_supports_rpc())


def _proc_address(reg_name: bytes, fn_name: bytes) -> int | None:
    lib = _ggml()
    reg = lib.ggml_backend_reg_by_name(reg_name)
    return lib.ggml_backend_reg_get_proc_address(reg, fn_name) if reg else None


def row_split_supported() -> bool:
    """Whether the CUDA backend still offers split buffers (llama.cpp's row split needs them)."""
    init_backend(_VERBOSE[0])
    return bool(_proc_address(b"CUDA", b"ggml_backend_split_buffer_type"))


def register_rpc(endpoint: str) -> None:
    """Make an rpc-server's devices ggml devices (named RPC0, RPC1, ...). The caller has checked that the
    server answers: ggml aborts the process when it cannot connect."""
    init_backend(_VERBOSE[0])
    fn = _proc_address(b"RPC", b"ggml_backend_rpc_add_server")
    if not fn:
        raise RuntimeError("this llama.cpp has no RPC backend")
    server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(fn)(endpoint.encode())
    if not server:
        raise RuntimeError(f"the RPC server {endpoint} offers no device")
    if not any(d.description == endpoint for d in devices()):  # ggml keeps one registry per endpoint
        _ggml().ggml_backend_register(server)


_SPLIT_MODES = {"none": lc.LLAMA_SPLIT_MODE_NONE, "layer": lc.LLAMA_SPLIT_MODE_LAYER, "row": lc.LLAMA_SPLIT_MODE_ROW}


def _device_handles(names: tuple[str, ...]) -> ctypes.Array:
    """ggml's handles of the named devices, NULL-terminated, in the order given."""
    lib = _ggml()
    by_name = {lib.ggml_backend_dev_name(h).decode(): h
               for h in (lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count()))}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise RuntimeError(f"no device {', '.join(missing)} (devices: {', '.join(by_name)})")
    return (ctypes.c_void_p * (len(names) + 1))(*[by_name[n] for n in names], None)


def model_params(config: EngineConfig) -> lc.llama_model_params:
    params = lc.llama_model_default_params()
    params.n_gpu_layers = config.n_gpu_layers
    params.use_extra_bufts = not cpu_has_amx()
    params.split_mode = _SPLIT_MODES[config.split_mode]
    params.main_gpu = config.main_gpu
    if config.devices:
        handles = _device_handles(config.devices)
        params.devices = ctypes.cast(handles, ctypes.c_void_p)
        params._keep_devices = handles  # alive until the model is loaded
    if config.tensor_split:
        shares = (ctypes.c_float * lc.LLAMA_MAX_DEVICES)(*config.tensor_split)
        params.tensor_split = shares
        params._keep_split = shares
    return params


def context_params(config: EngineConfig, sequences: int = 1) -> lc.llama_context_params:
    params = lc.llama_context_default_params()
    params.n_ctx = config.n_ctx
    params.n_batch = config.n_batch
    params.n_ubatch = min(config.n_ubatch, config.n_batch)
    params.n_seq_max = sequences
    params.kv_unified = sequences > 1  # parked sequences take the one context's free cells, not a share each
    params.n_threads, params.n_threads_batch = config.threads(), config.batch_threads()
    params.flash_attn_type = (lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if config.flash_attn
                              else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    params.type_k = GGML_TYPES[config.type_k]
    params.type_v = GGML_TYPES[config.type_v]
    params.swa_full = config.swa_full
    params.no_perf = False
    params.n_outputs_max_per_seq = DRAFT_MAX + 1  # a greedy draw in the graph also draws a verification's rows
    return params
