"""Loopback ports for the servers the tests start (torch-free: the deploy and Redis helpers import it too)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port free now (the kernel's pick). Another socket may take it before it is bound again: a server
    that binds it later says so (EADDRINUSE), and tests.testing.ServerThread(metrics=True) then tries another."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
