"""The peers the benchmark compares against: llama.cpp's llama-server (cache_prompt) and llama-bench."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from localchat import runtime
from localchat.engine import EngineConfig, cpu_has_amx

CPU_PEER_SERVER = str(Path("~/.cache/localchat-peers/bin/llama-server").expanduser())  # scripts/cpu_peers.sh builds it


@contextmanager
def runtime_and_peer(model: str, profile_name: str, server: str) -> Iterator[tuple[runtime.Runtime, PeerServer]]:
    """A paired script's runtime, and llama-server (`server`) on the same model and settings."""
    profile = runtime.load_profile(profile_name, {"model": model})
    with runtime.open_runtime(profile, lambda _: None) as rt, PeerServer(server, rt.engine.config) as peer:
        yield rt, peer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _common_flags(c: EngineConfig) -> list[str]:
    flags = ["-m", c.model_path, "-t", str(c.threads()), "-ngl", str(c.n_gpu_layers if c.n_gpu_layers >= 0 else 999)]
    return flags


class PeerServer:
    """llama-server on loopback with one slot, the same model and settings as localchat."""

    def __init__(self, path: str, c: EngineConfig, template: str = "", flags: tuple[str, ...] = (),
                 log: Path | None = None):
        """`template`: a chat template file, rendered by llama-server's own Jinja (--jinja): tool calls; `log`:
        where its own log goes (its timings per request)."""
        self.port = _free_port()
        cmd = [path, *_common_flags(c), "-c", str(c.n_ctx), "-b", str(c.n_batch), "-ub", str(c.n_ubatch),
               "-fa", "on" if c.flash_attn else "off", "-ctk", c.type_k, "-ctv", c.type_v, "-np", "1",
               "--host", "127.0.0.1", "--port", str(self.port), "--no-webui"]
        if template:
            cmd += ["--jinja", "--chat-template-file", template]
        cmd += flags
        if cpu_has_amx():
            cmd.append("--no-repack")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                     stderr=log.open("ab") if log is not None else subprocess.DEVNULL)

    def __enter__(self) -> PeerServer:
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.05)  # a cold start is timed (the assistant bench's pipe): ready is seen within 50 ms
        raise RuntimeError("llama-server did not become ready")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def completion(self, prompt: list[int], n_predict: int) -> dict:
        """Stream a greedy completion; TTFT is taken here, at the client."""
        body = json.dumps({"prompt": prompt, "n_predict": n_predict, "cache_prompt": True, "stream": True,
                           "temperature": 0, "top_k": 1, "ignore_eos": False}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        ttft = 0.0
        timings: dict = {}
        for raw in resp:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data: "):
                continue
            data = json.loads(line[6:])
            if not ttft and (data.get("content") or data.get("tokens")):
                ttft = time.perf_counter() - t0
            if data.get("stop"):
                timings = data.get("timings", {})
                break
        conn.close()
        return {"ttft_s": ttft, "prompt_n": int(timings.get("prompt_n", 0)),
                "prompt_ms": float(timings.get("prompt_ms", 0.0)),
                "decode_tps": float(timings.get("predicted_per_second", 0.0))}

    def sampled(self, prompt: list[int], n_predict: int, sampling: dict) -> dict:
        """A completion at these sampler settings, not streamed (no per-token HTTP in its decode): its decode
        rate from its own timings, over the steps after the first token as localchat's (n - 1 tokens)."""
        body = json.dumps({"prompt": prompt, "n_predict": n_predict, "cache_prompt": False, "stream": False,
                           **sampling}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = json.loads(resp.read() or b"{}")
        conn.close()
        if resp.status != 200:
            raise RuntimeError(f"llama-server answered {resp.status}: {str(data)[:300]}")
        timings = data.get("timings", {})
        n, ms = int(timings.get("predicted_n", 0)), float(timings.get("predicted_ms", 0.0))
        return {"tokens": n, "decode_tps": (n - 1) / ms * 1000 if n > 1 and ms > 0 else 0.0}

    def erase(self) -> None:
        """Empty the slot's cache: the next request starts cold."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("POST", "/slots/0?action=erase", b"{}", {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        conn.close()
        if resp.status != 200:
            raise RuntimeError(f"llama-server did not erase its slot ({resp.status})")

    def chat(self, messages: list[dict], tools: list[dict], max_tokens: int, tool_choice: str = "",
             sampling: dict | None = None) -> dict:
        """/v1/chat/completions, greedy, the cache kept: wall seconds, prompt tokens evaluated, reply tokens and
        the reply's message (its content and tool_calls); `sampling`: more of its sampling fields (the penalty)."""
        request: dict = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "top_k": 1,
                         "cache_prompt": True, "stream": False, **(sampling or {})}
        if tools:
            request["tools"] = tools
        if tool_choice:
            request["tool_choice"] = tool_choice
        body = json.dumps(request).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = json.loads(resp.read() or b"{}")
        wall = time.perf_counter() - t0
        conn.close()
        if resp.status != 200:
            raise RuntimeError(f"llama-server answered {resp.status}: {str(data)[:300]}")
        timings = data.get("timings", {})
        return {"wall_s": wall, "prompt_n": int(timings.get("prompt_n", 0)),
                "prompt_s": float(timings.get("prompt_ms", 0.0)) / 1000,
                "predicted_n": int(timings.get("predicted_n", 0)),
                "message": (data.get("choices") or [{}])[0].get("message", {})}


def run_llama_bench(path: str, c: EngineConfig, depth: int, n_gen: int, repeat: int = 3) -> float:
    """llama-bench's decode speed (tokens/s) at a context depth, same model and settings."""
    cmd = [path, *_common_flags(c), "-p", "0", "-n", str(n_gen), "-d", str(depth), "-fa", "1" if c.flash_attn else "0",
           "-ctk", c.type_k, "-ctv", c.type_v, "-ub", str(c.n_ubatch), "-r", str(repeat), "-o", "json"]
    if cpu_has_amx():
        cmd += ["--repack", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {out.stderr.strip()[-300:]}")
    rows = json.loads(out.stdout)
    return float(rows[0]["avg_ts"]) if rows else 0.0
