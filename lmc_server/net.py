"""Host strings to endpoints, address families and the loopback rule (IPv4 and IPv6).

A host may be an IPv4 address, an IPv6 address with or without brackets (``::1``,
``[::1]``) or a name; :func:`tcp_endpoint` makes the zmq endpoint (brackets around IPv6
literals). zmq sockets only speak IPv6 with the ``IPV6`` option set, which every socket
of the server and the clients sets (it keeps IPv4 working: the sockets are dual-stack).

The loopback rule: a host is loopback if it is ``127.0.0.0/8``, ``::1``, or a name all of
whose addresses are. ``::``, ``0.0.0.0``, ``*`` and any other address are not.

vLLM's bind-or-connect rule for its KV-event PUB endpoint (:func:`binds`) is read here
too, so that the server's exposure check and its publisher agree on what is bound.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable
from typing import Any

Resolver = Callable[..., list[tuple[Any, ...]]]

#: One label of a host name (RFC 1123): letters, digits and inner hyphens.
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
#: Longest host name (RFC 1035).
MAX_NAME_CHARS = 253
#: Where a server listens by default, and so where its clients look (the server's
#: ``--host``/``--port``, the vLLM connector's ``lmcache.mp.host``/``port``).
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 5555


def bare_host(host: str) -> str:
    """``[::1]`` -> ``::1``; anything else unchanged."""
    h = host.strip()
    return h[1:-1] if h.startswith("[") and h.endswith("]") else h


def is_ipv6_literal(host: str) -> bool:
    try:
        return ipaddress.ip_address(bare_host(host)).version == 6
    except ValueError:
        return False


def tcp_endpoint(host: str, port: int) -> str:
    """``tcp://HOST:PORT`` with IPv6 literals bracketed (``tcp://[::1]:5555``)."""
    h = bare_host(host)
    return f"tcp://[{h}]:{port}" if ":" in h else f"tcp://{h}:{port}"


def host_problem(
    host: str, bind: bool = False, resolver: Resolver = socket.getaddrinfo
) -> str | None:
    """Why ``host`` cannot be connected to (or, with ``bind``, listened on), or None.

    Accepted: IPv4 and IPv6 literals (IPv6 with or without brackets) and host names of
    RFC 1123 labels that resolve; with ``bind``, also ``*`` (every address). The
    message ends a sentence starting with the host, e.g. ``host 'a b' is not ...``, so
    a mistake is a one-line refusal instead of an error deep in zmq or the resolver.
    """
    h = host.strip()
    if bind and h == "*":
        return None
    if not h:
        return "is empty"
    inner = bare_host(h)
    if h.startswith("[") != h.endswith("]") or (inner != h and not is_ipv6_literal(inner)):
        return "is not an address: brackets hold an IPv6 address, as in [::1]"
    try:
        ipaddress.ip_address(inner)
        return None
    except ValueError:
        pass
    name = inner[:-1] if inner.endswith(".") else inner
    if len(name) > MAX_NAME_CHARS or not all(_LABEL.fullmatch(x) for x in name.split(".")):
        return (
            "is not an address: use an IPv4 address, an IPv6 address (::1 or [::1]) or a host name"
        )
    if not resolve(name, resolver):
        return "does not resolve to an address"
    return None


def resolve(host: str, resolver: Resolver = socket.getaddrinfo) -> list[str]:
    """Every address ``host`` stands for (a literal stands for itself)."""
    h = bare_host(host)
    try:
        return [str(ipaddress.ip_address(h))]
    except ValueError:
        pass
    try:
        infos = resolver(h, None, 0, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return sorted({str(info[4][0]).split("%", 1)[0] for info in infos})


def is_loopback(host: str, resolver: Resolver = socket.getaddrinfo) -> bool:
    """True if only this machine can reach ``host`` (see the module docstring)."""
    if bare_host(host) in ("*", ""):
        return False
    addrs = resolve(host, resolver)
    return bool(addrs) and all(ipaddress.ip_address(a).is_loopback for a in addrs)


def address_family(host: str, resolver: Resolver = socket.getaddrinfo) -> socket.AddressFamily:
    """The family to bind ``host`` with: IPv6 for IPv6 literals and names that resolve
    only to IPv6 addresses, IPv4 otherwise."""
    addrs = resolve(host, resolver)
    if addrs and all(ipaddress.ip_address(a).version == 6 for a in addrs):
        return socket.AF_INET6
    return socket.AF_INET


def binds(endpoint: str) -> bool:
    """vLLM's rule for its KV-event PUB endpoint, kept so a vLLM ``--kv-events-config``
    endpoint means the same here: bind a wildcard (``*``, ``::``) or ipc endpoint,
    connect to any other (a router that binds its SUB socket, as llm-d's indexer does
    centrally)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def endpoint_host(endpoint: str) -> str | None:
    """The host of a ``tcp://HOST:PORT`` endpoint (``*`` for a wildcard), None for any
    other transport."""
    if not endpoint.startswith("tcp://"):
        return None
    return endpoint[len("tcp://") :].rsplit(":", 1)[0]
