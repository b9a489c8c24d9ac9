"""Whether a host can be reached: one TCP connection with a timeout (``cannot_connect``), for a tracking server or
database named in a spec (orchestrator/spec/reach.py) and for the place pretrained weights download from
(``unreachable``, asked before a download the local cache cannot spare: a machine without internet gets one line at
once instead of the hub client's five retries, 52 s on a machine without DNS, 2026-12-01)."""
from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

# With a proxy the machine may reach the host only through it: the download client is left to try.
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def hub_url() -> str:
    """The Hugging Face hub the download would go to (HF_ENDPOINT: a mirror)."""
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def unreachable(url: str, timeout: float = 3.0) -> str | None:
    """Why ``url``'s host cannot be reached (its name does not resolve, or no TCP connection within ``timeout``
    seconds), as "HOST cannot be reached (why)"; None when it can, or when a proxy is configured."""
    if any(os.environ.get(v) for v in PROXY_VARS):
        return None
    try:
        u = urlsplit(url)
        host, port = u.hostname, u.port or (443 if u.scheme == "https" else 80)
    except ValueError:  # a malformed URL (bad port, broken IPv6 literal): the download client says what is wrong
        return None
    if not host:
        return None
    try:
        why = cannot_connect(host, port, timeout)
    except UnicodeError:  # a host name IDNA cannot encode: left to the client too
        return None
    return f"{host} cannot be reached ({why})" if why else None


def cannot_connect(host: str, port: int, timeout: float) -> str | None:
    """Why one TCP connection to host:port failed within ``timeout`` seconds ("timed out", "Connection refused",
    "Name or service not known", ...), or None when it opened."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return "timed out" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__)
    return None
