"""A real MCP server written with the SDK's server side, started by the tests: `python -m
tests.mcp_servers.notes` serves stdio; `... http PORT` serves Streamable HTTP on 127.0.0.1:PORT/mcp.
Its tools are the cases a client must survive: an answer, a hang, a flood, a raise, a child process."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("notes", log_level="WARNING")
FACTS = {"bread": "Bread is made of flour, water and salt.", "lease": "The lease ends on 31 March."}


@server.tool(structured_output=False)
def lookup(topic: str) -> str:
    """Look a topic up in the user's notes."""
    return FACTS.get(topic.lower(), f"nothing about {topic}")


@server.tool(structured_output=False)
async def wait(seconds: float) -> str:
    """Wait, then say so."""
    await asyncio.sleep(seconds)
    return f"waited {seconds} s"


@server.tool(structured_output=False)
def flood() -> str:
    """Ten megabytes of text."""
    return "flood " * ((10 << 20) // 6)


@server.tool(structured_output=False)
def boom() -> str:
    """Always fails."""
    raise RuntimeError("the notes are on fire")


@server.tool(structured_output=False)
def helper() -> str:
    """Starts a helper process (as servers do) and gives its pid and the server's."""
    child = subprocess.Popen(["sleep", "300"])
    return f"{os.getpid()} {child.pid}"


@server.resource("notes://today", mime_type="text/plain", description="Today's notes")
def today() -> str:
    return "Buy milk. Call the landlord about the lease."


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        server.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
