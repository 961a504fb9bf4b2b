"""Why llama.cpp could not load a model, in one line with what to do: its own reason, read from the
log it writes during the load, matched to the remedy (upgrade llama-cpp-python, re-download the file,
pick another one)."""

from __future__ import annotations

import re

import llama_cpp as lc

UPGRADE = 'pip install --upgrade "llama-cpp-python>=0.3.36"'
_REASON = re.compile(r"error loading model(?: hyperparameters| vocabulary| architecture)?: (.+)")
_LOADER = re.compile(r"llama_model_load(?:er)?: (.+)")
_GGUF = re.compile(r"gguf_\w+: (.+)")

# (what llama.cpp says, what it means for the user, what to do)
_REMEDIES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"unknown model architecture: '([^']*)'"),
     "its architecture '{0}' is not known to the llama.cpp of llama-cpp-python {version}; a newer one may "
     "know it: " + UPGRADE),
    (re.compile(r"unknown (?:pre-)?tokenizer(?: type)?: '([^']*)'"),
     "its tokenizer '{0}' is not known to the llama.cpp of llama-cpp-python {version}; a newer one may know "
     "it: " + UPGRADE),
    (re.compile(r"tensor '([^']*)' not found|wrong number of tensors|tensor '([^']*)' has wrong shape|"
                r"missing tensor|tensor data is not within the file bounds|tensor '[^']*' has offset"),
     "its tensors do not match its metadata ({reason}): the file is damaged or from an incompatible "
     "converter; re-download it or pick another file"),
    (re.compile(r"key not found in model: (\S+)|key (\S+) has wrong type|invalid gguf type for (\S+)"),
     "its metadata is damaged ({reason}); re-download it or pick another file"),
    (re.compile(r"CLIP cannot be used as main model"),
     "it is a vision projector (mmproj), not a language model; load the model it belongs to"),
]


class LoadLog:
    """The lines llama.cpp logs while one model loads (fed from the process's log callback)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.active = False

    def start(self) -> None:
        self.lines, self.active = [], True

    def stop(self) -> None:
        self.active = False

    def feed(self, text: str) -> None:
        if self.active and len(self.lines) < 10_000:  # a flood of log lines is not kept whole
            self.lines.append(text)

    def reason(self) -> str:
        """llama.cpp's own reason for the failure ('' when it logged none)."""
        text = "".join(self.lines)
        found = [r.strip() for r in _REASON.findall(text)]
        if found and "failed to load model from" not in found[-1]:
            return found[-1]
        gguf = [r.strip() for r in _GGUF.findall(text) if "failed to read" not in r]  # the container's reason
        if gguf:
            return gguf[0]
        if found:
            return found[-1]
        loader = [m for m in _LOADER.findall(text) if "failed to load model" not in m and "loaded meta" not in m]
        return loader[-1].strip() if loader else ""


def explain(path: str, reason: str) -> str:
    """The one line a failed load ends with: the file, llama.cpp's reason, and the remedy."""
    name = path.rsplit("/", 1)[-1]
    for pattern, remedy in _REMEDIES:
        m = pattern.search(reason)
        if m:
            first = next((g for g in m.groups() if g), "")
            return f"{name}: " + remedy.format(first, version=lc.__version__, reason=reason)
    if reason:
        return f"{name}: llama.cpp could not load it: {reason}; the file may be damaged: re-download it or pick " \
               "another file (--verbose shows llama.cpp's whole log)"
    return f"{name}: llama.cpp could not load it (run with --verbose for its log)"


LOAD_LOG = LoadLog()
