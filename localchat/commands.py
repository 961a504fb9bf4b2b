"""The subcommands besides the chat: models, plan, sessions, search, cache, profiles, mcp, bench, doctor,
completions. Each command's parser is built by a function of `PARSERS`; what only running a command needs
(the runtime and llama_cpp, numpy through the GGUF reader, YAML, the session store) is imported inside it, so
that building a parser stays cheap: the shells' completion builds one at every Tab."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from localchat import completion
from localchat.errors import ModelError, ProfileError, SessionError
from localchat.options import Parser, overrides, print_json, profile_args, setting_args
from localchat.settings import rule, settings_table
from localchat.ui.reports import Reports, printable

if TYPE_CHECKING:
    from localchat.session.sessiondir import SessionDir


def _out(text: str = "") -> None:
    """A line of a command's output; on a terminal what could steer it is shown (transcripts hold tool results)."""
    sys.stdout.write((printable(text) if sys.stdout.isatty() else text) + "\n")


_report = Reports()  # diagnostics on stderr: a progress line redrawn in place, untrusted text shown, not obeyed


# ---------------------------------------------------------------- models
def models_parser() -> argparse.ArgumentParser:
    p = Parser(prog="localchat models", description="GGUF models found on this machine")
    p.add_argument("--json", action="store_true")
    return p


def cmd_models(argv: Sequence[str]) -> int:
    from localchat.chatformat.templates import template_problem
    from localchat.machine import models
    from localchat.machine.fetch import BUILTIN_MODELS
    from localchat.machine.gguf_file import read_gguf
    args = models_parser().parse_args(argv)
    rows: list[dict[str, Any]] = []
    fetched = {}
    for alias in BUILTIN_MODELS:
        cached = models.builtin_cached(alias)
        if cached is None:
            rows.append({"name": alias, "source": "built-in (fetched on first use)", "path": None})
        else:
            fetched[cached] = alias
    for found in models.discover():
        source = f"built-in {fetched[found.path]}" if found.path in fetched else found.source
        row: dict[str, Any] = {"name": found.name, "source": source, "path": str(found.path)}
        try:
            g = read_gguf(found.path)
            m = models.model_info(found.path, g)
            row.update(arch=m.arch, params=m.n_params, quant=m.quant, size=m.file_size, n_ctx_train=m.n_ctx_train,
                       kv_bytes_per_token_f16=m.kv_bytes_per_token(), chat_template=m.has_chat_template,
                       sliding_window=m.n_swa, embedding=m.embeds_only)
            refused = template_problem(g.get("tokenizer.chat_template"), "tokenizer.chat_template" in g.invalid_utf8)
            if refused:
                row["template_refused"] = refused
            if m.problem:
                row["would_not_load"] = m.problem
        except ModelError as exc:
            row["error"] = str(exc)
        rows.append(row)
    return _table(rows, args.json, f"{'name':<36} {'arch':<8} {'params':>7} {'quant':<7} {'size':>8} {'ctx':>7} "
                  f"{'KV B/tok':>9} tmpl  source", _model_line,
                  lambda r: None if "arch" in r else f"{r['name']:<36} {r.get('error', r['source'])}")


def _table(rows: list[dict[str, Any]], as_json: bool, header: str, lines: Callable[[dict[str, Any]], list[str]],
           failed: Callable[[dict[str, Any]], str | None]) -> int:
    """A listing as JSON, or a header and each row's lines (a row that failed: its one line)."""
    if as_json:
        print_json(rows)
        return 0
    _out(header)
    for r in rows:
        bad = failed(r)
        for line in [bad] if bad is not None else lines(r):
            _out(line)
    return 0


def _model_line(r: dict[str, Any]) -> list[str]:
    tmpl = "REFUSED" if "template_refused" in r else "yes" if r["chat_template"] else "no"
    out = [f"{r['name'][:36]:<36} {r['arch']:<8} {r['params'] / 1e9:>6.2f}B {r['quant']:<7} "
           f"{r['size'] / 1e9:>6.2f}GB {r['n_ctx_train']:>7} {r['kv_bytes_per_token_f16']:>9,} {tmpl:<5} {r['source']}"]
    if "template_refused" in r:
        out.append(f"    its chat template is refused: {r['template_refused']}")
    if "would_not_load" in r:
        out.append(f"    {r['would_not_load']}")
    if r.get("embedding"):
        out.append("    an embedding model: for embedding_model (search by meaning), not for chat")
    return out


# ---------------------------------------------------------------- plan
def plan_parser() -> argparse.ArgumentParser:
    p = Parser(prog="localchat plan", description="memory plan for a profile and a model")
    profile_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable; keys documented in docs/profiles.md")
    return p


def cmd_plan(argv: Sequence[str]) -> int:
    from localchat import runtime
    from localchat.machine import plan as planmod
    from localchat.machine import planview
    args = plan_parser().parse_args(argv)
    profile = runtime.load_profile(args.profile, overrides(args))
    info = runtime.resolve_model(profile, _report)
    profile, plans = runtime.plans_for_command(runtime.fit_trained_context(profile, info, args.n_ctx is not None,
                                                                           _report), info)
    plan = plans.chat
    if args.json:
        if plans.why_not_card:  # the text form says it among its lines
            _report(f"localchat: warning: {plans.why_not_card}")
        print_json(plans.to_json())
    else:
        _out(f"profile    {profile.name} ({profile.source})")
        for line in planview.describe_plans(plans):
            _out(line)
        if profile.draft_model:
            draft, need, room = runtime.draft_need(profile, plan, _report)
            where = (f"{room / (1 << 20):,.0f} MiB left on the card -> {'fits' if need <= room else 'DOES NOT FIT'}"
                     if plan.gpu else "in RAM beside the model")
            _out(f"draft      {draft.name}: {need / (1 << 20):,.0f} MiB (weights, f16 KV, compute), {where}")
        if profile.embedding_model:
            embedding = runtime.embedding_for(profile, _report)
            assert embedding is not None
            size = os.path.getsize(embedding.path) + EMBED_COMPUTE
            _out(f"embedding  {os.path.basename(embedding.path)}: {size / (1 << 20):,.0f} MiB of RAM beside that total "
                 "(weights, compute), loaded by the search indexer for its first message")
    planmod.check_fits(plan, profile)
    info.check_loadable()  # the plan holds; the file itself would not load
    return 0


# ---------------------------------------------------------------- sessions
def verify_session(s: SessionDir) -> list[str]:
    """Every check a resume makes, without loading the model. Returns problems (empty: all good)."""
    from localchat.session import statefile
    from localchat.session.fingerprint import fingerprint
    from localchat.session.kvdisk import check_state, read_saved
    problems = []
    conv = s.conversation()
    if not conv.messages:
        problems.append("transcript is empty or unreadable")
    meta = s.read_meta()
    if not meta:
        problems.append("metadata missing or damaged")
    if not s.state.exists():
        problems.append("no saved KV state (the next resume rebuilds it from the transcript)")
        return problems
    model_path = meta.get("model", {}).get("path")
    fp = None
    if model_path:
        try:
            fp = fingerprint(model_path)
        except OSError:
            problems.append(f"model file {model_path} is not there (state kept)")
    settings = meta.get("kv_settings")
    try:
        saved = read_saved(s.state, check_segments=True)
        statefile.read_payload(s.state, saved.header, saved.offset)
        if saved.torn:
            problems.append(f"{saved.torn} (the resume restores the save before it)")
        check_state(dataclasses.replace(saved.header, tokens=saved.tokens), conv.window_tokens(), fp,
                    settings if isinstance(settings, dict) else None)
    except statefile.StateRejected as exc:
        problems.append(f"KV state rejected: {exc}")
    return problems


def export_markdown(s: SessionDir) -> str:
    conv = s.conversation()
    lines = [f"# {s.name}", ""]
    if conv.system:
        lines += [f"**system:** {conv.system}", ""]
    for m in conv.messages:
        mark = " (cut)" if m.cut else ""
        if m.role == "tool":
            mark += f" ({m.call.get('name', '?')}, {m.call.get('status', '?')})"
        lines += [f"**{m.role}**{mark}:", ""]
        if m.reasoning:
            lines += ["> *reasoning:*", *(f"> {line}" for line in m.reasoning.splitlines()), ""]
        if m.documents:
            lines += ["*attached: " + ", ".join(f"{d['name']} ({d['tokens']:,} tokens)" for d in m.documents) + "*", ""]
        lines += [_fenced(m.words) if m.role == "tool" else m.words, ""]
        lines += [f"*calls {c['name']}* `{json.dumps(c.get('arguments', {}), ensure_ascii=False)}`" for c in m.calls]
        lines += [""] if m.calls else []
    return "\n".join(lines)


def _fenced(text: str) -> str:
    """A tool's result as a code block whose fence no run of backticks in it closes."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}\n{text}\n{fence}"


def sessions_parser() -> argparse.ArgumentParser:
    p = Parser(prog="localchat sessions", description="saved sessions")
    p.add_argument("action", nargs="?", default="list", choices=("list", "show", "verify", "rm", "export", "remake"))
    p.add_argument("name", nargs="?")
    p.add_argument("--json", action="store_true")
    p.add_argument("--format", choices=("md", "json"), default="md", help="export format")
    p.add_argument("--limit", type=int, default=3, help="remake: the most recent states another "
                   "llama-cpp-python wrote, checked and made again where refused")
    profile_args(p)
    return p


def cmd_sessions(argv: Sequence[str]) -> int:
    from localchat.session import listing
    from localchat.session.sessiondir import SessionDir
    args = sessions_parser().parse_args(argv)
    if args.action == "list":
        rows = listing.session_rows()
        if args.json:
            print_json(rows)
        for line in listing.tree_lines(rows) if not args.json else []:
            _out(line)
        return 0
    if args.action == "remake":
        from localchat.session import remake
        quiet: Callable[[str], None] = lambda text: None  # noqa: E731
        done = remake.remake(args.profile or "cpu", overrides(args), args.limit, quiet if args.json else _out)
        if args.json:
            print_json([vars(r) for r in done])
        return 0
    if not args.name:
        raise SessionError(f"'sessions {args.action}' needs a session name")
    s = SessionDir(args.name)
    if not s.exists():
        raise SessionError(f"no session named '{args.name}' (see 'localchat sessions')")
    if args.action == "show":
        row = listing.session_row(s)
        if args.json:
            print_json({**row, "meta": s.read_meta()})
        else:
            _out(export_markdown(s))
    elif args.action == "verify":
        problems = verify_session(s)
        if args.json:
            print_json({"name": s.name, "ok": not problems, "problems": problems})
        else:
            _out(f"{s.name}: " + ("all checks pass" if not problems else "; ".join(problems)))
        return 0 if not problems else 1
    elif args.action == "rm":
        s.remove()
        _forget(s.name)
        _out(f"removed session '{s.name}'")
    elif args.action == "export":
        if args.format == "json":
            print_json(s.conversation().to_json())
        else:
            _out(export_markdown(s))
    return 0


def _forget(name: str) -> None:
    """A removed session's rows out of the search index, where there is one."""
    from localchat.session.searchindex import FAILURES, SearchIndex, index_path
    if index_path().exists():
        try:
            SearchIndex().remove(name)
        except FAILURES:
            pass  # the next search drops sessions that are gone


EMBED_COMPUTE = 144 << 20  # all-MiniLM's context and buffers for a 1,024-token batch: 187 MiB RSS less its file


def _embedding_progress(done: int, total: int) -> None:
    """The once-only embedding of the history, where it takes a while (every message since the model was set)."""
    if total >= 100:
        _report(f"\rlocalchat: embedding past messages for search by meaning: {done:,} of {total:,}"
                + ("\n" if done >= total else ""))


def search_parser() -> argparse.ArgumentParser:
    p = Parser(prog="localchat search", description="search every session's messages")
    p.add_argument("query", nargs="+")
    p.add_argument("--session", help="only this session")
    p.add_argument("--since", metavar="DATE", help="from this date on (YYYY-MM-DD[THH:MM])")
    p.add_argument("--until", metavar="DATE", help="before this date")
    p.add_argument("--role", choices=("user", "assistant", "tool"), help="only the user's, the model's or tools'")
    p.add_argument("--thoughts", action="store_true", help="search reasoning models' thoughts too")
    p.add_argument("--summaries", action="store_true",
                   help="search the model's summaries of compacted turns too (never a match for your own words "
                        "otherwise)")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--words", action="store_true", help="by words alone, where the profile sets an embedding_model")
    p.add_argument("--json", action="store_true")
    profile_args(p)
    return p


def cmd_search(argv: Sequence[str]) -> int:
    """search QUERY: every session's messages, best matches first."""
    from localchat import runtime
    from localchat.session.memory import matches
    from localchat.session.searchindex import FAILURES, hit_lines, search_kinds
    args = search_parser().parse_args(argv)
    profile = runtime.load_profile(args.profile, overrides(args))
    embedding = None if args.words else runtime.embedding_for(profile, _report, threads=os.cpu_count() or 1)
    try:
        kinds = search_kinds(args.role, args.thoughts, args.summaries)
        hits, notice = matches(" ".join(args.query), args.limit, embedding, _embedding_progress, session=args.session,
                               since=args.since, until=args.until, kinds=kinds)
    except FAILURES as exc:
        raise ProfileError(f"search: {exc}") from None
    if notice:
        _report(f"localchat: {notice}")
    if args.json:
        print_json([h.to_json() for h in hits])
        return 0
    for line in hit_lines(hits) or ["no matches"]:
        _out(line)
    return 0


# ---------------------------------------------------------------- the prefix store
def cache_parser() -> argparse.ArgumentParser:
    p = Parser(prog="localchat cache", description="the prefix store: the saved KV of system prompts and attached "
                                                   "documents that new chats start from")
    p.add_argument("action", nargs="?", default="list", choices=("list", "rm", "clear"))
    p.add_argument("key", nargs="*", help="rm: keys (or their first characters) as 'cache list' shows them")
    p.add_argument("--json", action="store_true")
    return p


def cmd_cache(argv: Sequence[str]) -> int:
    from localchat.session import prefixcache
    args = cache_parser().parse_args(argv)
    found = prefixcache.entries()
    if args.action == "list":
        rows: list[dict[str, Any]] = [{"key": e.key, "size": e.size, "tokens": e.tokens, "documents": e.documents,
                                       "model": e.model, "last_used": e.used} for e in found]
        if args.json:
            print_json(rows)
            return 0
        for r in rows:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["last_used"]))
            what = ", ".join(r["documents"]) or "system prompt"
            _out(f"{r['key'][:12]}  {r['size'] / 1e6:>8.1f} MB  {r['tokens'] or '?':>7} tok  {when}  "
                 f"{r['model'] or '-':<24} {what}")
        _out(f"{len(rows)} states, {sum(r['size'] for r in rows) / 1e6:.1f} MB (capped with sessions' KV by "
             "max_kv_disk_gb; least recently used go first)")
        return 0
    if args.action == "rm" and not args.key:
        raise SessionError("'cache rm' needs a key from 'localchat cache list'")
    chosen = found if args.action == "clear" else [e for e in found if any(e.key.startswith(k) for k in args.key)]
    if args.action == "rm" and not chosen:
        raise SessionError(f"no stored state with key {' '.join(args.key)} (see 'localchat cache list')")
    for e in chosen:
        prefixcache.remove(e)
    _out(f"removed {len(chosen)} states ({sum(e.size for e in chosen) / 1e6:.1f} MB)")
    return 0


# ---------------------------------------------------------------- profiles
def profiles_parser() -> argparse.ArgumentParser:
    p = Parser(prog="localchat profiles", description="shipped and user profiles")
    p.add_argument("--json", action="store_true")
    p.add_argument("--keys", action="store_true", help="every key a profile may set: type, default, values, option")
    p.add_argument("--markdown", action="store_true", help="with --keys: as the Markdown table docs/profiles.md holds")
    return p


def cmd_profiles(argv: Sequence[str]) -> int:
    from localchat.machine import profiles
    args = profiles_parser().parse_args(argv)
    if args.keys:
        return _keys(args.json, args.markdown)
    rows = []
    for name, path in profiles.available().items():
        row: dict[str, Any] = {"name": name, "path": str(path),
                               "source": "shipped" if path.parent == profiles.shipped_dir() else "user"}
        try:
            prof = profiles.load(name)
            row.update(vram_gb=prof.vram_gb, gpus=prof.gpus if prof.split_mode != "none" else 1, n_ctx=prof.n_ctx,
                       type_k=prof.type_k, type_v=prof.type_v, n_gpu_layers=prof.n_gpu_layers, model=prof.model,
                       rpc_servers=list(prof.rpc_servers))
        except ProfileError as exc:
            row["error"] = str(exc)
        rows.append(row)
    return _table(rows, args.json, f"{'name':<12} {'card':>9} {'n_ctx':>7} {'KV':<10} {'offload':<8} {'from':<8} file",
                  _profile_line, lambda r: f"{r['name']:<12} {r['error']}" if "error" in r else None)


def _profile_line(r: dict[str, Any]) -> list[str]:
    card = (f"{r['gpus']}x " if r["gpus"] > 1 else "") + f"{r['vram_gb']:g} GB" if r["vram_gb"] else "CPU"
    card += " +RPC" if r["rpc_servers"] else ""
    kv = r["type_k"] if r["type_k"] == r["type_v"] else f"{r['type_k']}/{r['type_v']}"
    offload = {0: "none", -1: "all"}.get(r["n_gpu_layers"], f"{r['n_gpu_layers']} layers")
    return [f"{r['name']:<12} {card:>9} {r['n_ctx']!s:>7} {kv:<10} {offload:<8} {r['source']:<8} {r['path']}"]


def _keys(as_json: bool, markdown: bool) -> int:
    rows = settings_table()
    if as_json:
        print_json(rows)
    elif markdown:
        _out("| key | default | valid values | option | what it sets |")
        _out("|---|---|---|---|---|")
        for r in rows:
            option = f"`{r['option']}`" if r["option"] else ""
            _out(f"| `{r['key']}` | `{r['default']}` | {r['values']} | {option} | {r['help']} |")
    else:
        for r in rows:
            option = f" ({r['option']})" if r["option"] else ""
            _out(f"{r['key']:<19} {r['default']:<9} {r['help']}{option}; {r['values']}")
    return 0


def cmd_bench(argv: Sequence[str]) -> int:
    from localchat.bench import command
    return command.main(argv)


def serve_parser() -> argparse.ArgumentParser:
    p = Parser(prog="localchat serve", description="Serve the profile's model to other programs through OpenAI's "
                                                   "and Anthropic's APIs; each conversation's KV is kept, across "
                                                   "requests and restarts, as a session.")
    profile_args(p)
    setting_args(p, chat=True)  # the sampling a request leaves to the server
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: loopback only; another "
                   "one needs --api-key)")
    p.add_argument("--port", type=int, default=8080, help="the port (default: 8080)")
    p.add_argument("--api-key", default="", metavar="KEY", help="the key every request must bring (Authorization: "
                   "Bearer KEY, or x-api-key: KEY)")
    return p


def cmd_serve(argv: Sequence[str]) -> int:
    from localchat import runtime, serve
    args = serve_parser().parse_args(argv)
    serve.check_address(args.host, args.api_key)
    serve.check_port(args.host, args.port)
    profile = runtime.load_profile(args.profile, overrides(args))
    return serve.run(profile, args.host, args.port, args.api_key, _report, verbose=args.verbose,
                     explicit_ctx=args.n_ctx is not None)


def mcp_parser() -> argparse.ArgumentParser:
    p = Parser(prog="localchat mcp")
    p.add_argument("action", choices=("list", "check"))
    p.add_argument("name", nargs="?", help="one server (default: all)")
    profile_args(p)
    return p


def cmd_mcp(argv: Sequence[str]) -> int:
    """mcp list|check [NAME]: start each configured server, list its tools with what their schemas cost
    in tokens of the profile's model, stop it."""
    from localchat import runtime
    from localchat.engine.vocab import Tokenizer
    from localchat.paths import config_dir, home
    from localchat.tools import mcpconfig
    from localchat.tools.mcp import Hub
    args = mcp_parser().parse_args(argv)
    specs = mcpconfig.load()
    if not specs:
        raise ProfileError(f"no MCP servers are configured: write {config_dir() / 'mcp.json'}")
    if args.name and args.name not in specs:
        raise ProfileError(f"no server {args.name!r} in {mcpconfig.config_path()} (configured: {', '.join(specs)})")
    profile = runtime.load_profile(args.profile, overrides(args))
    tokenizer = Tokenizer(str(runtime.resolve_model(profile, _report).path))
    hub = Hub([specs[n] for n in ([args.name] if args.name else specs)], home() / "mcp-logs")
    try:
        hub.wait()
        failed = 0
        for name, server in hub.servers.items():
            failed += not server.state.startswith("ready")
            for line in _server_lines(name, server, tokenizer, args.action == "check"):
                _out(line)
    finally:
        hub.close()
        tokenizer.close()
    return 2 if failed else 0


def _server_lines(name: str, server: Any, tokenizer: Any, whole: bool) -> list[str]:
    from localchat.tools.toolset import full_name, offered_schema, schema_tokens
    took = f", up in {server.up_s:.2f} s" if whole and server.up_s else ""
    lines = [f"{name} ({server.spec.transport}: {server.spec.where()}): {server.state}{took}"]
    for tool in server.tools:
        cost = schema_tokens(offered_schema(full_name(name, tool.name), tool), tokenizer.tokenize)
        offered = server.spec.tools is None or tool.name in server.spec.tools
        lines.append(f"  {full_name(name, tool.name):<32} {cost:>6,} tok  {'' if offered else '(not offered) '}"
                     f"{tool.description.splitlines()[0][:60] if tool.description else ''}")
        if whole:
            lines.append(f"    {json.dumps(tool.schema)}")
    lines += [f"  resource {uri} ({title})" for uri, title in server.resources]
    return lines


def doctor_parser() -> argparse.ArgumentParser:
    p = Parser(prog="localchat doctor", description="check this machine in one screen: the llama.cpp build, its "
                                                   "devices, the profile that fits, a real load, the state")
    p.add_argument("--profile", "-p", help="profile name or YAML path for the load (default: the shipped profile "
                   "that fits this machine)")
    model = rule("model")
    p.add_argument(model.flag, model.short, dest="model", help=model.help)
    p.add_argument("--no-load", action="store_true", help="skip loading the model (no offload check, no speeds)")
    p.add_argument("--json", action="store_true", help="one object: ok, model, profile, checks")
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging, llama.cpp's log included")
    return p


def cmd_doctor(argv: Sequence[str]) -> int:
    args = doctor_parser().parse_args(argv)
    from localchat import doctor  # it loads llama_cpp as it is imported
    return doctor.main(args)


def completions_parser() -> argparse.ArgumentParser:
    p = Parser(prog="localchat completions", description="a script that completes localchat's command line: eval "
                                                         "\"$(localchat completions bash)\", or install it where the "
                                                         "shell looks for completions")
    p.add_argument("shell", choices=completion.SHELLS)
    return p


def cmd_completions(argv: Sequence[str]) -> int:
    args = completions_parser().parse_args(argv)
    _out(completion.script(args.shell))
    return 0


# every command's parser, built without running it (the shells' completion reads them); bench's is built in a module
# that loads llama_cpp as it is imported: it completes by name only
PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "models": models_parser, "plan": plan_parser, "sessions": sessions_parser, "search": search_parser,
    "cache": cache_parser, "profiles": profiles_parser, "mcp": mcp_parser, "completions": completions_parser,
    "serve": serve_parser, "doctor": doctor_parser}


def run(name: str, argv: Sequence[str]) -> int:
    return {"doctor": cmd_doctor, "models": cmd_models, "plan": cmd_plan, "sessions": cmd_sessions, "bench": cmd_bench,
            "profiles": cmd_profiles, "cache": cmd_cache, "mcp": cmd_mcp, "search": cmd_search,
            "completions": cmd_completions, "serve": cmd_serve}[name](argv)

