"""The machine and its memory plan: profiles, model files and the GGUF reader, built-in models, placement over
devices, RPC servers, threads. Never imports the engine: the plan works without llama.cpp."""
