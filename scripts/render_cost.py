"""What bounding the chat template costs per render: the same render in jinja2's sandbox in this
process (how localchat rendered before the bounds) and in the bounded child process (now), for the
demo model's template and gpt-oss's (a large official one, from the llama-cpp-python source release),
conversations of 4 and 40 messages. Medians of 200 renders, interleaved; JSON on stdout.

usage: python scripts/render_cost.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localchat.fetch import ensure_builtin  # noqa: E402
from localchat.gguf_file import read_gguf  # noqa: E402
from localchat.templatebox import BOX  # noqa: E402
from tests.official_templates import templates_dir  # noqa: E402


def conversation(n: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "You are a helpful assistant. " * 20}]
    for i in range(n // 2):
        msgs += [{"role": "user", "content": f"Question {i}: what about the history of bread and ovens? " * 3},
                 {"role": "assistant", "content": f"Answer {i}: bread was baked in clay ovens. " * 8}]
    return msgs + [{"role": "user", "content": "And then?"}]


def main() -> int:
    demo = read_gguf(ensure_builtin("demo", lambda t: None)).get("tokenizer.chat_template")
    templates = {"demo (SmolLM2 ChatML)": demo,
                 "gpt-oss": (templates_dir() / "openai-gpt-oss-120b.jinja").read_text()}
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=lambda m: None, strftime_now=lambda f: datetime.now().strftime(f))
    out: dict = {}
    BOX.render(demo, {"messages": conversation(4), "add_generation_prompt": True})  # the child starts once
    for name, source in templates.items():
        compiled = env.from_string(source)
        for n in (4, 40):
            ctx = {"messages": conversation(n), "add_generation_prompt": True, "bos_token": "", "eos_token": ""}
            inproc, boxed = [], []
            for _ in range(200):
                t0 = time.perf_counter()
                a = compiled.render(**ctx)
                t1 = time.perf_counter()
                b = BOX.render(source, ctx)
                t2 = time.perf_counter()
                inproc.append(t1 - t0)
                boxed.append(t2 - t1)
                assert a == b
            out[f"{name}, {n} messages"] = {"in_process_ms": round(1000 * statistics.median(inproc), 3),
                                            "bounded_child_ms": round(1000 * statistics.median(boxed), 3),
                                            "rendered_chars": len(a)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
