"""llama.cpp's RPC servers, asked before llama.cpp is: each address checked (RPC has no authentication
and no encryption, so public addresses need the user's explicit consent), each server greeted in its
own protocol and asked for its devices' memory. ggml aborts the whole process when a server it
connects to is down or speaks another protocol version; this module turns that into one line."""

from __future__ import annotations

import ipaddress
import socket
import struct
from dataclasses import dataclass

from localchat.errors import ProfileError

# ggml-rpc's protocol (ggml/src/ggml-rpc/ggml-rpc.cpp of llama-cpp-python 0.3.36): version 7.x
PROTO_MAJOR = 7
CMD_GET_DEVICE_MEMORY, CMD_HELLO, CMD_DEVICE_COUNT = 11, 14, 15
CONN_CAPS = 24  # bytes of transport capabilities in HELLO; all zero: plain TCP
TIMEOUT_S = 5.0


@dataclass(frozen=True)
class RemoteDevice:
    endpoint: str
    index: int  # the device's number on its server
    free: int
    total: int


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ProfileError(f"RPC server '{endpoint}': not host:port (for example 192.168.1.20:50052)")
    return host, int(port)


def _addresses(host: str, port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ProfileError(f"RPC server '{host}:{port}': the name does not resolve ({exc.strerror or exc})") from None
    return [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]


def check_address(endpoint: str, allow_public: bool) -> None:
    """Loopback, private and link-local addresses pass; anything else only with allow_public."""
    host, port = split_endpoint(endpoint)
    public = [a for a in _addresses(host, port) if not (a.is_loopback or a.is_private or a.is_link_local)]
    if public and not allow_public:
        raise ProfileError(f"RPC server '{endpoint}' is at a public address ({public[0]}): llama.cpp's RPC is "
                           "unauthenticated and unencrypted, keep it to a trusted network (or pass --rpc-public)")


def _call(sock: socket.socket, cmd: int, payload: bytes, reply_size: int) -> bytes:
    sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    head = _read(sock, 8)
    (size,) = struct.unpack("<Q", head)
    if size != reply_size:
        raise ValueError(f"reply of {size} bytes to command {cmd}, expected {reply_size}")
    return _read(sock, size)


def _read(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        data += chunk
    return data


def probe(endpoint: str, timeout: float = TIMEOUT_S) -> list[RemoteDevice]:
    """The server's devices and their memory now, or one line saying why not."""
    host, port = split_endpoint(endpoint)
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            hello = _call(sock, CMD_HELLO, bytes(CONN_CAPS), 4 + CONN_CAPS)
            major, minor, patch = hello[0], hello[1], hello[2]
            if major != PROTO_MAJOR:
                raise ProfileError(f"RPC server {endpoint} speaks protocol {major}.{minor}.{patch}, this llama.cpp "
                                   f"{PROTO_MAJOR}.x: run an rpc-server built from the same llama.cpp version")
            (count,) = struct.unpack("<I", _call(sock, CMD_DEVICE_COUNT, b"", 4))
            found = []
            for i in range(count):
                free, total = struct.unpack("<QQ", _call(sock, CMD_GET_DEVICE_MEMORY, struct.pack("<I", i), 16))
                found.append(RemoteDevice(endpoint, i, free, total))
    except TimeoutError:
        raise ProfileError(f"RPC server {endpoint} did not answer within {timeout:g} s (an rpc-server serves one "
                           "client at a time: is another chat using it?)") from None
    except (OSError, ValueError, struct.error) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
        raise ProfileError(f"RPC server {endpoint} does not answer as an rpc-server: {why}") from None
    if not found:
        raise ProfileError(f"RPC server {endpoint} offers no device")
    return found
