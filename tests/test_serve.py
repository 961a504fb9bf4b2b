"""`localchat serve` driven by the official OpenAI and Anthropic SDKs, as other programs drive it: replies
streamed and not, a re-sent history evaluating only what is new (the usage's cached tokens), the cache kept
across a restart, tool calls round-tripped on the real built-in model, bad requests answered in the API's own
error shape while the server goes on, a key required off loopback, a client gone mid-stream stopping its
generation."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import anthropic
import openai
import psutil
import pytest

from localchat.bench.peer import _free_port
from tests.conftest import run_cli

SYSTEM = "You are a terse assistant."


class Server:
    def __init__(self, model: Path, home: Path, *args: str, key: str = ""):
        self.port = _free_port()
        env = {**os.environ, "LOCALCHAT_HOME": str(home)}
        self.log = home.parent / f"serve-{self.port}.log"
        home.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-m", "localchat", "serve", "--model", str(model), "--port",
                                      str(self.port), *args], env=env, stdout=subprocess.DEVNULL,
                                     stderr=self.log.open("w"))
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 300
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                self.health(key)
                return
            except OSError:
                assert time.time() < deadline, "the server did not start"
                time.sleep(0.2)

    def health(self, key: str = "") -> dict:
        req = urllib.request.Request(self.url + "/health", headers={"x-api-key": key} if key else {})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    def settle(self) -> None:
        """Wait for the idle work: the KV brought to the next request's start and saved."""
        deadline = time.time() + 120
        while not self.health()["settled"]:
            assert time.time() < deadline
            time.sleep(0.1)

    def openai(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=300)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key="none", max_retries=0, timeout=300)

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGINT)
        assert self.proc.wait(120) == 0, self.log.read_text()
        return self.log.read_text()


@pytest.fixture(scope="module")
def demo_server(demo_path, tmp_path_factory):
    server = Server(demo_path, tmp_path_factory.mktemp("serve") / "home", "--temperature", "0", "--ctx", "1024")
    yield server
    server.stop()


def _post(server: Server, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + path, data=body, method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_openai_sdk_re_sending_its_history_evaluates_only_what_is_new(demo_server):
    client = demo_server.openai()
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a color."}]
    first = client.chat.completions.create(model="demo", messages=msgs, max_tokens=12)
    assert first.choices[0].message.content and first.usage.prompt_tokens_details.cached_tokens == 0
    demo_server.settle()
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And another one?"}]
    stream = client.chat.completions.create(model="demo", messages=msgs, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text and chunks[-2].choices[0].finish_reason in ("stop", "length")
    # the history (system, question, reply) comes from the KV: what is evaluated is the new message's tokens
    assert usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens <= 16


def test_the_anthropic_sdk_streams_and_reads_the_cache(demo_server):
    client = demo_server.anthropic()
    msgs = [{"role": "user", "content": "Say hello."}]
    first = client.messages.create(model="demo", max_tokens=12, system=[{"type": "text", "text": SYSTEM}],
                                   messages=msgs)
    assert first.content[0].type == "text" and first.content[0].text
    demo_server.settle()
    msgs += [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "Once more."}]
    with client.messages.stream(model="demo", max_tokens=12, system=SYSTEM, messages=msgs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text and final.stop_reason in ("end_turn", "max_tokens")
    prior = first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens
    assert final.usage.cache_read_input_tokens >= prior - 1
    assert final.usage.input_tokens <= 16


def test_a_volatile_billing_header_costs_nothing(demo_server):
    """Claude Code's per-request header line in the system prompt: left out, so the cache holds."""
    client = demo_server.anthropic()
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.99.a1b; cc_entrypoint=cli; "
               "cch=1f2e3;"}, {"type": "text", "text": SYSTEM + " Answer in one word."}]
    first = client.messages.create(model="demo", max_tokens=8, system=system,
                                   messages=[{"role": "user", "content": "Pick a fruit."}])
    demo_server.settle()
    system[0]["text"] = "x-anthropic-billing-header: cc_version=2.1.99.c4d; cc_entrypoint=cli; cch=9a8b7;"
    second = client.messages.create(model="demo", max_tokens=8, system=system, messages=[
        {"role": "user", "content": "Pick a fruit."}, {"role": "assistant", "content": first.content[0].text},
        {"role": "user", "content": "Another."}])
    prior = first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens
    assert second.usage.cache_read_input_tokens >= prior - 1


def test_a_json_schema_holds_the_answer_to_it(demo_server):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "sure": {"type": "boolean"}}, "required": ["color", "sure"]}
    reply = demo_server.openai().chat.completions.create(
        model="demo", max_tokens=40, messages=[{"role": "user", "content": "Pick a color of the flag of Italy."}],
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}})
    answer = json.loads(reply.choices[0].message.content)
    assert answer["color"] in ("red", "green", "blue") and isinstance(answer["sure"], bool)


def test_a_seeded_request_samples_the_same_twice(demo_path, tmp_path):
    """On a fresh server: the second request's tokens lie in cells after the first's (other conversations' cells
    among them would change the order llama.cpp sums attention in, and so the last bits of the logits)."""
    server = Server(demo_path, tmp_path / "home", "--ctx", "1024")

    def ask() -> str:
        return server.openai().chat.completions.create(
            model="demo", max_tokens=24, temperature=1.0, seed=7,
            messages=[{"role": "user", "content": "Invent a name for a cat."}]).choices[0].message.content
    first, second = ask(), ask()
    server.stop()
    assert first == second, (first, second)


def _talk(server: Server, history: list[dict], words: str) -> tuple[int, int]:
    """One more turn of a conversation (its history grown in place); (prompt tokens, cached tokens)."""
    history.append({"role": "user", "content": words})
    reply = server.openai().chat.completions.create(model="demo", messages=history, max_tokens=12)
    history.append({"role": "assistant", "content": reply.choices[0].message.content})
    return reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens


def test_clients_taking_turns_each_find_their_kv_parked_in_a_sequence(demo_path, tmp_path):
    """Two clients' conversations alternate: each request finds its own KV in a llama.cpp sequence of the same
    context (nothing copied to memory, nothing read from disk) and evaluates only what is new."""
    server = Server(demo_path, tmp_path / "home", "--temperature", "0", "--ctx", "2048")
    a = [{"role": "system", "content": "You are a gardener. " * 20}]
    b = [{"role": "system", "content": "You are a sailor. " * 20}]
    sizes = {"a": _talk(server, a, "What grows in spring?")[0], "b": _talk(server, b, "What is a knot?")[0]}
    for turn in range(2):
        for name, history, words in (("a", a, f"And in month {turn + 3}?"), ("b", b, f"And knot {turn + 2}?")):
            before = sizes[name] + 12
            prompt, cached = _talk(server, history, words)
            assert cached >= before - 1, (name, turn, prompt, cached, before)  # its whole last prompt and reply
            sizes[name] = prompt
    health = server.health()
    log = server.stop()
    assert health["parked"] == 1 and health["in_memory"] == 0, health
    assert " from disk)" in log and all("(0 from disk)" in line for line in log.splitlines() if "from disk" in line)


def test_parked_conversations_leave_for_memory_when_the_context_needs_their_cells(demo_path, tmp_path):
    """Five conversations of ~300 tokens in a 1,024-token context: the least used parked ones are copied to memory
    as the cells run out; every request is answered, and the first conversation's next turn finds its KV still."""
    server = Server(demo_path, tmp_path / "home", "--temperature", "0", "--ctx", "1024")
    talks = [[{"role": "system", "content": f"You are helper number {i}. " + "Answer briefly. " * 80}]
             for i in range(5)]
    first = [_talk(server, history, "Say hello.")[0] for history in talks]
    assert all(n > 250 for n in first), first
    health = server.health()
    assert health["in_memory"] >= 1 and health["parked"] >= 1, health
    prompt, cached = _talk(server, talks[0], "Say goodbye.")
    server.stop()
    assert cached >= first[0] + 12 - 1, (prompt, cached, first[0])


def test_tools_for_a_template_without_them_are_not_offered(demo_server):
    reply = demo_server.openai().chat.completions.create(model="demo", max_tokens=8, tools=TOOLS,
                                                         messages=[{"role": "user", "content": "Hi"}])
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    assert "takes no tools" in demo_server.log.read_text()


BAD = [
    (b"{not json", 400), (b"[1, 2]", 400), (json.dumps({"messages": "hi"}).encode(), 400),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": 9}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "x"}] * 10_000}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "x"}],
                 "tools": [{"type": "function", "function": {"name": "bad name!", "parameters": {}}}]}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": "all"}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "x"}],
                 "response_format": {"type": "json_schema"}}).encode(), 400),
    (json.dumps({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
                ).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "word " * 3000}]}).encode(), 400),  # past the context
    (b"x" * (10 << 20), 413),
]


def test_bad_requests_get_the_apis_error_and_the_server_goes_on(demo_server):
    client = demo_server.openai()
    client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    rss = psutil.Process(demo_server.proc.pid).memory_info().rss
    for body, status in BAD:
        code, answer = _post(demo_server, "/v1/chat/completions", body)
        assert (code, set(answer)) == (status, {"error"}), (body[:80], answer)
        assert answer["error"]["message"]
    code, answer = _post(demo_server, "/v1/messages", json.dumps({"messages": [{"role": "user", "content": "x"}]}
                                                                  ).encode())
    assert code == 400 and answer["type"] == "error" and "max_tokens" in answer["error"]["message"]
    code, answer = _post(demo_server, "/v1/messages", json.dumps({"max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "tool_result"}]}]}).encode())
    assert code == 400 and "tool_use_id" in answer["error"]["message"]
    code, answer = _post(demo_server, "/v1/messages", json.dumps({"max_tokens": 4, "messages": [  # Claude Code's
        {"role": "user", "content": "Hi"}, {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello?"}]}).encode())
    assert code == 200 and answer["content"][0]["type"] == "text"
    with pytest.raises(openai.BadRequestError, match="does not fit the context"):
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "word " * 3000}],
                                       stream=True)
    reply = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert reply.choices[0].message.content is not None
    grown = psutil.Process(demo_server.proc.pid).memory_info().rss - rss
    assert grown < 64 << 20, f"RSS grew {grown >> 20} MiB over the bad requests"


def test_a_client_that_goes_away_mid_stream_stops_the_generation(demo_server):
    before = demo_server.health()["requests"]
    stream = demo_server.openai().chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Write a very long story about a dragon."}],
        max_tokens=900, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    demo_server.settle()
    assert demo_server.health()["requests"] == before + 1
    log = demo_server.log.read_text().splitlines()
    line = [line for line in log if f"request {before + 1} " in line][-1]
    generated = int(re.search(r"(\d+) generated", line).group(1))
    assert generated < 60, log[-1]  # of 900: it stopped within a few tokens of the client going


def test_requests_queue_on_the_engine_and_health_says_so(demo_server):
    client = demo_server.openai()
    answers: dict[int, str] = {}

    def ask(i: int) -> None:
        reply = client.chat.completions.create(model="demo", max_tokens=48, messages=[
            {"role": "user", "content": f"Write a short poem about the number {i}."}])
        answers[i] = reply.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    most = 0
    while any(t.is_alive() for t in threads):
        most = max(most, demo_server.health()["queue"])
        time.sleep(0.02)
    assert sorted(answers) == [0, 1, 2] and all(answers.values())
    assert most >= 2 and "waits behind" in demo_server.log.read_text()


def test_the_cache_survives_a_restart_and_the_conversation_is_a_session(demo_path, tmp_path):
    home = tmp_path / "home"
    server = Server(demo_path, home, "--temperature", "0")
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about the lighthouse keeper."}]
    first = server.openai().chat.completions.create(model="demo", messages=msgs, max_tokens=16)
    server.settle()
    assert "(0 from disk)" in server.stop()
    server = Server(demo_path, home, "--temperature", "0")
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "What was his name?"}]
    second = server.openai().chat.completions.create(model="demo", messages=msgs, max_tokens=8)
    log = server.stop()
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert f"{cached} cached ({cached} from disk)" in log
    env = {"LOCALCHAT_HOME": str(home)}
    listed = run_cli(["sessions", "list", "--json"], env=env)
    assert listed.returncode == 0 and "served-" in listed.stdout
    found = run_cli(["search", "lighthouse"], env=env)
    assert found.returncode == 0 and "served-" in found.stdout, found.stdout + found.stderr


def test_another_address_needs_a_key_and_every_request_brings_it(demo_path, tmp_path):
    refused = run_cli(["serve", "--model", str(demo_path), "--host", "0.0.0.0"], env={"LOCALCHAT_HOME": str(tmp_path)})
    assert refused.returncode == 2 and "--api-key" in refused.stderr and refused.stderr.count("\n") == 1
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = run_cli(["serve", "--model", str(demo_path), "--port", str(taken.getsockname()[1])],
                       env={"LOCALCHAT_HOME": str(tmp_path)})
    assert busy.returncode == 2 and "cannot listen" in busy.stderr and busy.stderr.count("\n") == 1
    server = Server(demo_path, tmp_path / "home", "--host", "0.0.0.0", "--api-key", "s3cret", key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            server.openai("wrong").models.list()
        with pytest.raises(urllib.error.HTTPError):
            server.health()
        assert server.health("s3cret")["status"] == "ok"
        assert [m.id for m in server.openai("s3cret").models.list()] == [demo_path.stem]
    finally:
        server.stop()


TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a text file of the project.",
                                           "parameters": {"type": "object", "properties": {
                                               "path": {"type": "string", "description": "The file's path."}},
                                               "required": ["path"]}}}]
ASK = "When is the meeting? Check notes.txt."
RESULT = "Contents of notes.txt:\nThe team meeting is on Thursday at 15:30 in room B."
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}]


@pytest.mark.real
def test_a_tool_call_round_trips_through_both_apis_on_the_real_model(assistant_path, tmp_path):
    server = Server(assistant_path, tmp_path / "home", "--temperature", "0")
    try:
        client = server.openai()
        msgs = [{"role": "user", "content": ASK}]
        first = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        call = first.choices[0].message.tool_calls[0]
        assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "read_file"
        assert json.loads(call.function.arguments) == {"path": "notes.txt"}
        server.settle()
        msgs += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
        second = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        assert "15:30" in second.choices[0].message.content and not second.choices[0].message.tool_calls
        # the call as the template writes it back, then the result: only those are evaluated
        assert second.usage.prompt_tokens - second.usage.prompt_tokens_details.cached_tokens <= 40

        # this model calls the weather tool again after its result: the repeat is not handed back, it answers
        msgs = [{"role": "user", "content": "What's the weather in Paris right now?"}]
        first = client.chat.completions.create(model="m", messages=msgs, tools=WEATHER)
        msgs += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id,
                  "content": "Sunny, 21 °C, light wind from the west."}]
        second = client.chat.completions.create(model="m", messages=msgs, tools=WEATHER)
        assert "21" in second.choices[0].message.content and second.choices[0].finish_reason == "stop"
        assert "repeats the call just answered" in server.log.read_text()
        # streamed, nothing of a repeated call reaches the client before the answer (so described and after this
        # result the model once called again as {{"name": ...} and its first "{" was streamed)
        brief = [{"type": "function", "function": {**WEATHER[0]["function"], "description": "Current weather for a city"}}]
        msgs[-1]["content"] = '{"temp_c": 14, "sky": "light rain"}'
        streamed = client.chat.completions.create(model="m", messages=msgs, tools=brief, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text.startswith("The") and "14" in text, text

        # a plain question with a tool on: a call of a tool the client did not offer is never handed back
        plain = client.chat.completions.create(model="m", tools=WEATHER, messages=[
            {"role": "user", "content": "What is 2+2? Answer briefly."}])
        text = plain.choices[0].message.content or ""
        assert not plain.choices[0].message.tool_calls and plain.choices[0].finish_reason == "stop", plain
        assert "4" in text and '"name"' not in text and "```" not in text, text
        assert "add is not an offered tool" in server.log.read_text()  # this model calls an `add` it made up

        tools = [{"name": "read_file", "description": TOOLS[0]["function"]["description"],
                  "input_schema": TOOLS[0]["function"]["parameters"]}]
        ant = server.anthropic()
        turns = [{"role": "user", "content": ASK}]
        with ant.messages.stream(model="m", max_tokens=200, tools=tools, messages=turns) as stream:
            reply = stream.get_final_message()
        use = next(b for b in reply.content if b.type == "tool_use")
        assert reply.stop_reason == "tool_use" and (use.name, use.input) == ("read_file", {"path": "notes.txt"})
        server.settle()
        turns += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}]
        answer = ant.messages.create(model="m", max_tokens=200, tools=tools, messages=turns)
        assert "15:30" in answer.content[0].text and answer.stop_reason == "end_turn"
        assert answer.usage.input_tokens <= 40  # the result and its template text: the rest was cached
    finally:
        server.stop()


@pytest.mark.real
def test_a_reply_begun_by_the_client_goes_on_from_its_words(assistant_path, tmp_path):
    """A request ending with an assistant message asks the model to go on from it (Anthropic's prefill; a reply
    cut at max_tokens sent back): the prompt ends with those words, the answer is what follows them, and the
    conversation keeps the reply whole."""
    server = Server(assistant_path, tmp_path / "home", "--temperature", "0")
    try:
        ask = {"role": "user", "content": "What is the capital of France? Answer in JSON with a key capital."}
        prefilled = server.anthropic().messages.create(model="m", max_tokens=40, messages=[
            ask, {"role": "assistant", "content": '{"capital": "'}])
        assert prefilled.content[0].text.startswith("Paris"), prefilled  # after the words, not a reply of its own

        client = server.openai()
        msgs = [{"role": "user", "content": "Write a haiku about the sea."}]
        cut = client.chat.completions.create(model="m", messages=msgs, max_tokens=6)
        assert cut.choices[0].finish_reason == "length"
        server.settle()
        start = cut.choices[0].message.content
        rest = client.chat.completions.create(model="m", messages=[*msgs, {"role": "assistant", "content": start}],
                                              max_tokens=60)
        assert rest.choices[0].finish_reason == "stop" and not rest.choices[0].message.content.startswith(start)
        # the cut reply's tokens as sampled: only the last, never evaluated, is evaluated now
        assert rest.usage.prompt_tokens - rest.usage.prompt_tokens_details.cached_tokens == 1
        server.settle()
        kept = [r.get("content") for f in (tmp_path / "home" / "sessions").glob("*/transcript.jsonl")
                for r in map(json.loads, f.read_text().splitlines()) if r.get("role") == "assistant"]
        assert start + rest.choices[0].message.content in kept, kept
    finally:
        server.stop()
