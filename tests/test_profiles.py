"""Profiles: shipped ones load, `extends` inherits, user profiles override, every error is one clear line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from localchat.cli import chat_parser
from localchat.errors import ProfileError
from localchat.machine import profiles
from localchat.machine.profiles import with_overrides
from localchat.settings import SETTING_KEYS, rule
from tests.conftest import run_cli

SHIPPED = ["cpu", "rtx3060", "rtx4070", "rtx4060", "rtx3070", "h200"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_load_and_are_commented(name):
    p = profiles.load(name)
    assert p.name == name
    text = (profiles.shipped_dir() / f"{name}.yaml").read_text()
    assert text.lstrip().startswith("#")


def test_gpu_profiles_offload_everything_with_q8_kv_and_flash_attention():
    p = profiles.load("rtx3060")
    assert (p.n_gpu_layers, p.n_ctx, p.type_k, p.type_v, p.flash_attn, p.vram_gb) == (-1, "auto", "q8_0", "q8_0", True, 12)
    assert profiles.load("rtx4060").vram_gb == 8
    assert profiles.load("rtx3070").type_v == "q8_0"  # inherited through rtx4060 -> rtx3060


def _write(home, name, text):
    d = home / "profiles"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.yaml").write_text(text)
    return d / f"{name}.yaml"


def test_user_profile_extends_and_overrides_a_shipped_one(home):
    _write(home, "mine", "extends: rtx3060\nn_ctx: 8192\ntemperature: 0\n")
    p = profiles.load("mine")
    assert (p.n_ctx, p.temperature, p.type_k) == (8192, 0.0, "q8_0")
    _write(home, "rtx3060", "extends: rtx3060\nreserve_gb: 2\n")  # overrides the shipped one of that name
    assert profiles.load("rtx3060").reserve_gb == 2.0


def test_profile_by_path(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("extends: cpu\nmax_tokens: 64\n")
    assert profiles.load(str(f)).max_tokens == 64


@pytest.mark.parametrize("text, message", [
    ("n_ctxx: 4096\n", r"unknown key 'n_ctxx'; did you mean 'n_ctx'\?"),
    ("n_ctx: lots\n", r"key 'n_ctx' is out of range \('lots'\); it must be 'auto' or a number"),
    ("flash_attn: 1\n", r"key 'flash_attn' must be true or false, not int 1"),
    ("n_gpu_layers: true\n", r"key 'n_gpu_layers' must be -1 \(all\)"),
    ("temperature: 9\n", r"key 'temperature' is out of range \(9\)"),
    ("type_k: q5_k\n", r"key 'type_k' is out of range \('q5_k'\); it must be one of f16, q8_0, q4_0"),
    ("type_v: q8_0\nflash_attn: false\n", r"type_v: q8_0 needs flash attention; set flash_attn: true"),
    ("n_gpu_layers: -1\nflash_attn: true\ntype_k: q8_0\ntype_v: q4_0\n", r"no CUDA flash-attention kernel"),
    ("n_batch: 128\nn_ubatch: 512\n", r"n_ubatch \(512\) is larger than n_batch \(128\)"),
    ("[1, 2]\n", r"a profile is a mapping of keys to values, not a list"),
    ("a: [\n", r"not valid YAML at line"),
    ("extends: nosuch\n", r"no profile 'nosuch'"),
    ("extends: loop\n", r"extends unknown profile 'loop'"),
    ("x: &a [*a, *a]\n", r"unknown key 'x'"),
])
def test_each_validation_error_names_file_key_and_fix(home, text, message):
    path = _write(home, "loop", text)
    with pytest.raises(ProfileError, match=message) as exc:
        profiles.load("loop")
    assert str(path) in str(exc.value) or "no profile" in str(exc.value)
    assert "\n" not in str(exc.value)


def test_extends_cycle_is_refused(home):
    _write(home, "a", "extends: b\n")
    _write(home, "b", "extends: a\n")
    with pytest.raises(ProfileError, match="'extends' loops back"):
        profiles.load("a")


def test_non_utf8_and_huge_profiles_are_refused(home):
    path = _write(home, "bin", "")
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ProfileError, match="not UTF-8"):
        profiles.load("bin")
    path.write_text("# " + "x" * 300_000)
    with pytest.raises(ProfileError, match="larger than"):
        profiles.load("bin")


def test_unknown_profile_suggests_a_name():
    with pytest.raises(ProfileError, match=r"no profile 'rtx306'; did you mean 'rtx3060'\?"):
        profiles.load("rtx306")


def test_command_line_overrides_are_checked():
    with pytest.raises(ProfileError, match="--ctx: 12 is out of range"):
        profiles.with_overrides(profiles.load("cpu"), n_ctx=12)
    assert profiles.with_overrides(profiles.load("cpu"), n_ctx=1024, seed=None).n_ctx == 1024


def test_profiles_command_lists_shipped_and_user_profiles(home):
    import json

    from tests.conftest import run_cli
    _write(home, "mine", "extends: rtx4060\nreserve_gb: 1.5\n")
    _write(home, "broken", "n_ctxx: 4096\n")
    rows = {r["name"]: r for r in json.loads(run_cli(["profiles", "--json"], env={"LOCALCHAT_HOME": str(home)}).stdout)}
    assert {"cpu", "rtx3060", "rtx4060", "h200"} <= set(rows)
    assert rows["rtx3060"]["source"] == "shipped" and rows["rtx3060"]["vram_gb"] == 12
    assert rows["rtx3060"]["type_k"] == "q8_0" and rows["rtx3060"]["n_ctx"] == "auto"
    assert rows["mine"]["source"] == "user" and rows["mine"]["vram_gb"] == 8 and rows["mine"]["path"].endswith("mine.yaml")
    assert "did you mean 'n_ctx'" in rows["broken"]["error"]
    text = run_cli(["profiles"], env={"LOCALCHAT_HOME": str(home)}).stdout
    assert "rtx3060" in text and "12 GB" in text and "auto" in text
    assert rows["rtx3060x2"]["gpus"] == 2 and "rtx3060x2     2x 12 GB" in text  # two cards of 12 GB


def test_a_profile_context_above_the_trained_one_is_capped_and_a_command_line_one_refused(home, demo_path):
    from tests.conftest import run_cli
    env = {"LOCALCHAT_HOME": str(home)}
    r = run_cli(["--profile", "h200", "--model", str(demo_path), "--no-session", "--max-tokens", "4", "--temperature",
                 "0"], "Hello\n", env)
    assert r.returncode == 0, r.stderr
    assert "sets n_ctx 32768, above the trained context" in r.stderr and "using 8192" in r.stderr
    r = run_cli(["--model", str(demo_path), "--ctx", "16384", "--no-session"], "Hello\n", env)
    assert r.returncode == 2 and "--ctx 16384 is above the trained context" in r.stderr


def test_readme_lists_exactly_the_settings_table_and_the_options_come_from_it():
    readme = (Path(__file__).parent.parent / "docs" / "profiles.md").read_text()
    block = readme.split("<!-- keys: localchat profiles --keys --markdown -->\n")[1].split("<!-- /keys -->")[0]
    assert block == run_cli(["profiles", "--keys", "--markdown"]).stdout
    assert re.findall(r"^\| `(\w+)` \|", block, re.M) == list(SETTING_KEYS)
    flags = {o for a in chat_parser()._actions for o in a.option_strings}
    assert {rule(k).flag for k in SETTING_KEYS if rule(k).flag} <= flags
    keys = run_cli(["profiles", "--keys", "--json"]).stdout
    assert [r["key"] for r in json.loads(keys)] == list(SETTING_KEYS)


def test_an_option_out_of_range_names_the_option_and_what_it_takes():
    with pytest.raises(ProfileError, match=r"--ctx: 12 is out of range; it must be 'auto' or a number of tokens"):
        with_overrides(profiles.load("cpu"), n_ctx=12)
    with pytest.raises(ProfileError, match=r"--temperature: 9\.0 is out of range; it must be 0 \(greedy\) to 5"):
        with_overrides(profiles.load("cpu"), temperature=9.0)
