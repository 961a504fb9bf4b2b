"""Which first model load segfaults on a CUDA machine (kv_writes.py's restores did on an H100; the CLI's did not):
each variant in its own process, its exit code and last lines. python scripts/diag_load.py MODEL

Found on an H100 (2026-12-05): the two variants that import numpy before llama_cpp segfault in
llama_model_load_from_file; every other loads (the CLI imports llama_cpp first)."""
import subprocess
import sys

M = sys.argv[1]
LOAD = ("from localchat import runtime\n"
        "p = runtime.load_profile('h200', {'model': %r, 'n_ctx': %d, 'type_k': 'q8_0', 'type_v': 'q8_0'})\n"
        "rt = runtime.open_runtime(p, lambda t: None, explicit_ctx=%s)\n"
        "print('loaded', rt.engine.n_ctx, flush=True)\nrt.close()\n")
VARIANTS = {
    "numpy first, faulthandler": (["-X", "faulthandler"], "import numpy\n" + LOAD % (M, 22528, False)),
    "numpy first": ([], "import numpy\n" + LOAD % (M, 22528, False)),
    "localchat first": ([], LOAD % (M, 22528, False)),
    "explicit ctx": ([], LOAD % (M, 22528, True)),
    "ctx 4096": ([], LOAD % (M, 4096, False)),
    "f16 KV": ([], LOAD.replace("q8_0", "f16") % (M, 22528, False)),
}
for name, (flags, code) in VARIANTS.items():
    done = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, timeout=120)
    tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
    print(f"{name}: exit {done.returncode}: {' | '.join(tail)}", flush=True)
cli = subprocess.run([sys.executable, "-m", "localchat", "--profile", "h200", "--model", M, "--kv-type", "q8_0",
                      "--ctx", "22528", "--max-tokens", "1", "--no-session", "Hi"],
                     capture_output=True, text=True, timeout=120)
print(f"cli one-shot: exit {cli.returncode}: {cli.stderr.strip().splitlines()[-1:] if cli.stderr else ''}", flush=True)
