"""`localchat serve`: the chat's model and its kept KV behind OpenAI's and Anthropic's HTTP APIs."""

from __future__ import annotations

import logging
import signal
import socket
import sys
import time
from collections.abc import Callable

from localchat import runtime
from localchat.errors import UsageError
from localchat.host.scheduler import Scheduler
from localchat.host.served import PARKED, Served
from localchat.session.lifecycle import Session
from localchat.settings import Profile

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_address(host: str, api_key: str) -> None:
    if host not in LOOPBACK and not api_key:
        raise UsageError(f"--host {host} lets other machines in: give --api-key KEY too (clients send it as "
                         "'Authorization: Bearer KEY' or 'x-api-key: KEY')")


def check_port(host: str, port: int) -> None:
    """UsageError where the address cannot be listened on (before the model loads for nothing)."""
    if not 0 < port < 65536:
        raise UsageError(f"--port: {port} is out of range; it must be 1 to 65535")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (another server there? "
                             "--port N)") from None


def run(profile: Profile, host: str, port: int, api_key: str, report: Callable[[str], None], verbose: bool = False,
        explicit_ctx: bool = False) -> int:
    """Serve until interrupted; the conversations' KV is saved on the way out."""
    import uvicorn

    from localchat.serve.app import Front, make_app

    check_address(host, api_key)
    check_port(host, port)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("localchat serve: %(message)s"))
    served_log = logging.getLogger("localchat.serve")
    served_log.addHandler(handler)
    served_log.setLevel(logging.INFO)
    served_log.propagate = False
    with runtime.open_runtime(profile, report, verbose=verbose, explicit_ctx=explicit_ctx,
                              sequences=PARKED + 2) as rt:
        session = Session(rt, None, report, autosave=False, prefix_store=True)
        served = Served(session)
        scheduler = Scheduler(served)
        name = profile.model if profile.model and not profile.model.endswith(".gguf") and "/" not in profile.model \
            else rt.model.path.stem
        front = Front(served, scheduler, name, api_key, time.time())
        report(f"localchat serve: {name} on http://{host}:{port}/v1 (OpenAI: /v1/chat/completions, "
               f"Anthropic: /v1/messages; {len(served.kept)} conversations kept); Ctrl-C stops")
        # uvicorn stops on SIGINT and SIGTERM, then raises them again: both end here, the KV saved below
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            uvicorn.Server(uvicorn.Config(make_app(front), host=host, port=port, log_level="warning",
                                          access_log=False)).run()
        except KeyboardInterrupt:
            pass
        finally:
            scheduler.close()
            served.close()
            session.close()
    report("localchat serve: stopped; the conversations are saved")
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
