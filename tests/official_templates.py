"""Official chat templates of current model families, for the conformance tests, from PyPI (no hub).

llama.cpp keeps the templates of current families in its `models/templates/` folder, each copied
from the model's own repository, and the llama-cpp-python source release (on PyPI) carries that
folder. It is fetched once with pip into the models cache that the tests share.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from localchat import paths

SDIST = "llama-cpp-python==0.3.36"
FOLDER = "/vendor/llama.cpp/models/templates/"

# each line: the file in llama.cpp's models/templates/ | the family | the model repository it was copied from
_TABLE = """
meta-llama-Llama-3.1-8B-Instruct.jinja | Llama 3.1 | meta-llama/Llama-3.1-8B-Instruct
meta-llama-Llama-3.2-3B-Instruct.jinja | Llama 3.2 | meta-llama/Llama-3.2-3B-Instruct
meta-llama-Llama-3.3-70B-Instruct.jinja | Llama 3.3 | meta-llama/Llama-3.3-70B-Instruct
Qwen-Qwen2.5-7B-Instruct.jinja | Qwen2.5 | Qwen/Qwen2.5-7B-Instruct
Qwen-Qwen3-0.6B.jinja | Qwen3 (thinking) | Qwen/Qwen3-0.6B
Qwen3.5-4B.jinja | Qwen3.5 (thinking) | Qwen/Qwen3.5-4B
Qwen-QwQ-32B.jinja | QwQ (thinking) | Qwen/QwQ-32B
deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja | DeepSeek-R1 distill, Llama | deepseek-ai/DeepSeek-R1-Distill-Llama-8B
deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja | DeepSeek-R1 distill, Qwen | deepseek-ai/DeepSeek-R1-Distill-Qwen-32B
mistralai-Mistral-Nemo-Instruct-2407.jinja | Mistral Nemo (system prompt with the last message) | mistralai/Mistral-Nemo-Instruct-2407
Mistral-Small-3.2-24B-Instruct-2506.jinja | Mistral Small 3.2 | mistralai/Mistral-Small-3.2-24B-Instruct-2506
unsloth-mistral-Devstral-Small-2507.jinja | Devstral Small | unsloth/Devstral-Small-2507
microsoft-Phi-3.5-mini-instruct.jinja | Phi-3.5 | microsoft/Phi-3.5-mini-instruct
ibm-granite-granite-3.3-2B-Instruct.jinja | Granite 3.3 | ibm-granite/granite-3.3-2b-instruct
ibm-granite-granite-4.0.jinja | Granite 4.0 | ibm-granite/granite-4.0
CohereForAI-c4ai-command-r-plus-tool_use.jinja | Command R+ | CohereForAI/c4ai-command-r-plus
CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja | Command R7B (loop controls) | CohereForAI/c4ai-command-r7b-12-2024
HuggingFaceTB-SmolLM3-3B.jinja | SmolLM3 | HuggingFaceTB/SmolLM3-3B
google-gemma-2-2b-it.jinja | Gemma 2 (no system role) | google/gemma-2-2b-it
google-gemma-4-31B-it.jinja | Gemma 4 (thought channel) | google/gemma-4-31B-it
openai-gpt-oss-120b.jinja | gpt-oss (harmony channels) | openai/gpt-oss-120b
NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja | Hermes 3 | NousResearch/Hermes-3-Llama-3.1-8B
NVIDIA-Nemotron-Nano-v2.jinja | Nemotron Nano v2 (thinking) | nvidia/NVIDIA-Nemotron-Nano-9B-v2
GLM-4.6.jinja | GLM-4.6 (thinking) | zai-org/GLM-4.6
"""
TEMPLATES = {f: (family, source) for f, family, source in
             (tuple(x.strip() for x in line.split("|")) for line in _TABLE.strip().splitlines())}


def templates_dir() -> Path:
    """The folder of official templates, fetched from the llama-cpp-python source release on first use."""
    target = paths.models_dir() / f"templates-{SDIST.replace('==', '-')}"
    if (target / ".complete").exists():
        return target
    paths.private_dir(target)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                        "--disable-pip-version-check", "-d", tmp, SDIST], check=True, stdout=sys.stderr)
        archive = next(Path(tmp).glob("*.tar.gz"))
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                if FOLDER in member.name and member.name.endswith(".jinja") and member.isfile():
                    data = tar.extractfile(member)
                    assert data is not None
                    (target / Path(member.name).name).write_bytes(data.read())
    (target / ".complete").touch()
    return target
