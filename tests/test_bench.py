"""`localchat bench` on the real demo model: every mode does the same work, counted exactly.
Speeds are the benchmark's output, not asserted here."""

from __future__ import annotations

import json
import statistics
import sys

from tests.conftest import run_cli


def test_bench_modes_evaluate_the_same_tokens(tmp_path):
    out, requests = tmp_path / "bench.json", tmp_path / "requests"
    r = run_cli(["bench", "--profile", "cpu", "--model", "demo", "--turns", "4", "--system-tokens", "64",
                 "--user-tokens", "20", "--reply-tokens", "8", "--kv", "f16", "--repeat", "2", "--json", str(out),
                 "--peer-server", str(_stand_in_server(tmp_path, requests))], timeout=600)
    assert r.returncode == 0, r.stderr
    assert "ttft_ratio_recompute_over_localchat" in r.stdout  # the table and summary on stdout
    part = json.loads(out.read_text())["kv"]["f16"]
    rows, summary = part["rows"], part["summary"]

    def turn(mode, t, repeat=0):
        (row,) = [x for x in rows if x["mode"] == mode and x["turn"] == t and x["repeat"] == repeat]
        return row

    for t in range(1, 5):
        ours = turn("localchat" if t <= 2 else "resume", t)
        rec, raw = turn("recompute", t), turn("raw", t)
        assert ours["prompt_tokens"] == rec["prompt_tokens"] == raw["prompt_tokens"]
        assert rec["recomputed_tokens"] == rec["prompt_tokens"]  # no reuse at all
        if t > 1 and t != 3:  # turn 3 follows the resume, which chose its own way back
            assert ours["recomputed_tokens"] == raw["recomputed_tokens"] < ours["prompt_tokens"] // 2
    for k in (1, 2):  # the last turn again, each mode from the previous turn's cache
        again = [turn(m, 4, k)["recomputed_tokens"] for m in ("resume", "raw")]
        assert again[0] == again[1] == turn("resume", 4)["recomputed_tokens"] - 1
    assert summary["last_turn_samples"] == 3
    assert set(summary["ttft_last_turn_median_s"]) == {"localchat", "recompute", "raw", "server"}
    # llama-server replays each turn, then holds the reply the conversation goes on with (its own may differ), so
    # that its next turn, like localchat's and raw's, evaluates only what the turn adds
    asked = [json.loads(line) for line in requests.read_text().splitlines()]
    for k in range(4):
        turn_asked, primed = asked[2 * k], asked[2 * k + 1]
        assert (turn_asked["n_predict"], primed["n_predict"]) == (8, 1) and turn_asked["cache_prompt"]
        assert primed["prompt"][:len(turn_asked["prompt"])] == turn_asked["prompt"]
        assert len(primed["prompt"]) > len(turn_asked["prompt"])
        if k < 3:
            assert asked[2 * k + 2]["prompt"][:len(primed["prompt"])] == primed["prompt"]
    resume = summary["resume"]
    assert resume["chosen"] in ("restore", "re-prefill") and resume["tokens"] > 64
    assert resume["restore_first_token_s"] > resume["load_s"] > 0 and resume["reprefill_first_token_s"] > 0
    assert summary["decode_path_host_overhead_mb"] <= 200  # no n_batch x n_vocab array on the host
    paths = summary["paths"]  # by the way a turn starts: each after the one before, after a load, after an undo
    ours = {t: turn("localchat" if t <= 2 else "resume", t)["ttft_s"] for t in (2, 3, 4)}
    assert paths["natural_ttft_median_s"] == round(statistics.median([ours[2], ours[4]]), 4)  # turn 3: the resume
    assert paths["resumed_first_turn_over_natural"] == round(ours[3] / statistics.median([ours[2], ours[4]]), 3)
    assert set(paths["natural_over_raw_per_turn"]) == {"2", "4"} and "last_turn_again_over_natural" in paths


def test_decode_bench_measures_drafts_and_load_bench_reads_the_load(tmp_path):
    out, calls = tmp_path / "decode.json", tmp_path / "llama-bench-calls"
    # no llama-bench binary on this machine: a stand-in answering as it does (JSON rows), so the pairing of
    # each round's figures with its own llama-bench run is checked; its speeds mean nothing
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\n"
                    "case \" $* \" in *' -n 1 '*) echo '[{\"avg_ts\": 250.0}]';; *) echo '[{\"avg_ts\": 100.0}]';; esac\n")
    fake.chmod(0o755)
    r = run_cli(["bench", "--model", "demo", "--decode", "--load", "--repeat", "1", "--reply-tokens", "32", "--json",
                 str(out), "--llama-bench", str(fake)], timeout=900)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    repetitive, novel = result["decode"]["workloads"]["repetitive"], result["decode"]["workloads"]["not repetitive"]
    for part in (repetitive, novel):  # each round's rate over the llama-bench run of the same round
        lb = part["llama_bench"]
        assert lb["over_llama_bench"] == {m: round(part["runs"][m][0] / 100.0, 3) for m in part["runs"]}
        assert lb["tg1_ms"] == 4.0 and f"-d {lb['depth']} " in calls.read_text() and lb["depth"] > 0
        assert part["over_off"] == {m: round(part["runs"][m][0] / part["runs"]["off"][0], 3) for m in part["runs"]}
    assert repetitive["acceptance"]["on"] > 0.5  # the reply quotes the pasted notice: most drafts hold
    assert novel["reply_tokens"] == 256 and set(novel["decode_tps"]) == {"off", "auto", "on"}
    for part in (repetitive, novel):  # where greedy replies part, it is said (docs/profiles.md: Speed)
        assert all(part["first_difference"][m] is None for m in part["first_difference"]) == part["identical_replies"]
    assert repetitive["acceptance"]["off"] is None
    load = result["load"]
    cores = load["usable_cores"]
    assert set(load["busy"]) == {str(b) for b in {0, 1, cores}}
    assert load["busy"]["0"]["auto_threads"] == [cores]  # nothing else runs: every core
    assert load["busy"][str(cores)]["auto_threads"] == [1]  # every core busy: one thread, never none
    assert "decode with drafts from the conversation" in r.stdout and "busy background processes" in r.stdout


def test_typing_bench_reads_the_message_ahead_through_the_terminal_ui(tmp_path):
    """bench --typing drives the terminal UI's own code path: with read-ahead on, everything the turn evaluates
    was evaluated before Enter; read-ahead changes when tokens are evaluated, never which; each turn traced."""
    out = tmp_path / "typing.json"
    r = run_cli(["bench", "--typing", "--model", "demo", "--turns", "3", "--system-tokens", "64", "--user-tokens",
                 "24", "--paste-tokens", "120", "--reply-tokens", "8", "--repeat", "1", "--cps", "200",
                 "--json", str(out)], timeout=600)
    assert r.returncode == 0, r.stderr
    rows = {row["case"]: row for row in json.loads(out.read_text())["typing"]["rows"]}
    assert set(rows) == {"one word", "typed 150 tokens", "typed 150 tokens, read-ahead off", "paste 2000 + typed question",
                         "paste 2000 + question, read-ahead off", "one word, line mode"}
    for case in ("one word", "typed 150 tokens", "paste 2000 + typed question"):  # typed, then a pause, then Enter
        row = rows[case]
        assert row["read_ahead_tokens"] + row["idle_tokens"] >= row["recomputed_tokens"], row
        stages = [name for name, _ in row["trace"]["stages"]]
        assert stages.index("first_token") < stages.index("first_text") < stages.index("first_shown") \
            < stages.index("first_drawn"), stages
    for case in ("typed 150 tokens, read-ahead off", "paste 2000 + question, read-ahead off"):
        assert rows[case]["read_ahead_tokens"] == 0
        stages = [name for name, _ in rows[case]["trace"]["stages"]]  # a prefill's wait shows the view, not nothing
        assert stages.index("view_started") < stages.index("first_text") < stages.index("first_drawn"), stages
    pasted, off = rows["paste 2000 + typed question"], rows["paste 2000 + question, read-ahead off"]
    assert pasted["prompt_tokens"] == off["prompt_tokens"] and pasted["recomputed_tokens"] == off["recomputed_tokens"]


FAKE_SERVER = '''import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
log = open(sys.argv[1], "a")
class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        log.write(json.dumps(body) + "\\n"); log.flush()
        reply = {"content": "x", "timings": {"predicted_n": body["n_predict"], "predicted_ms": 2550.0}}
        data = json.dumps(reply).encode()
        if body.get("stream"):
            done = {"stop": True, "timings": {"prompt_n": 1, "prompt_ms": 1.0, "predicted_per_second": 100.0}}
            data = b"data: " + json.dumps({"content": "x"}).encode() + b"\\n\\ndata: " + json.dumps(done).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def log_message(self, *args):
        pass
HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def _stand_in_server(tmp_path, requests):
    """No llama-server binary on this machine: a stand-in answering /completion as it does (streamed or not),
    writing down what it is asked."""
    fake = tmp_path / "llama-server"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -c '{FAKE_SERVER}' {requests} \"$@\"\n")
    fake.chmod(0o755)
    return fake


def test_decode_bench_at_the_default_sampling_draws_as_llama_server_does(tmp_path):
    out, requests = tmp_path / "sampled.json", tmp_path / "requests"
    # no llama-server binary on this machine: a stand-in answering /completion as it does, so what it is asked
    # (the rendered prompt, the profile's sampler settings, each round's seed) and the pairing are checked
    r = run_cli(["bench", "--model", "demo", "--decode", "--sampling", "default", "--repeat", "2", "--reply-tokens",
                 "32", "--json", str(out), "--peer-server", str(_stand_in_server(tmp_path, requests))], timeout=900)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())["decode_sampled"]
    assert result["sampling"]["temperature"] == 0.7 and result["reply_tokens"] == 256
    asked = [json.loads(line) for line in requests.read_text().splitlines()]
    assert [a["seed"] for a in asked] == [1000, 1001, 1000, 1001]  # each round's own seed, as localchat's
    for a in asked:
        assert (a["temperature"], a["top_k"], a["top_p"], a["min_p"]) == (0.7, 40, 0.95, 0.05)
        assert a["n_predict"] == 256 and not a["cache_prompt"] and not a["stream"]
        assert a["dry_penalty_last_n"] >= 0  # llama-server's API refuses -1 (the whole context)
    for n, part in enumerate(result["workloads"].values()):
        assert len(asked[2 * n]["prompt"]) == part["prompt_tokens"] > 20  # the prompt localchat rendered
        assert part["runs"]["llama-server"] == [255 / 2.55] * 2  # over the tokens after the first
        for mode in ("off", "auto"):
            assert part["over_server"][mode] == round(statistics.median(v / 100 for v in part["runs"][mode]), 3)
            assert all(0 < n <= 256 for n in part["reply_tokens"][mode])
    assert result["workloads"]["repetitive"]["acceptance"] > 0.5  # the reply quotes the notice: drafts hold
    assert "decode at the profile's sampling" in r.stdout
