"""localchat: a terminal chat runtime for local GGUF models that keeps its KV cache."""

__version__ = "0.1.0"
