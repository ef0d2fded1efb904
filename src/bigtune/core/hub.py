"""Whether the Hugging Face hub answers, asked once per process, and the loading keywords that follow."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

_HUB_ANSWERS: Optional[bool] = None

PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub's host takes a connection at all (asked once per process).

    Compute nodes often have no internet. There, transformers retries every file it looks for with
    back-off before it gives up, minutes per load; once the host is known to be unreachable, loads go
    straight to the local cache (``local_files_only``) and a missing file fails at once. HF_HUB_OFFLINE
    says offline without asking; behind a proxy a direct connection proves nothing, so it is not tried.
    """
    global _HUB_ANSWERS
    if _HUB_ANSWERS is None:
        import os
        import socket
        from urllib.parse import urlparse

        if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
            _HUB_ANSWERS = False
        elif any(os.environ.get(v) for v in PROXY_VARS):
            _HUB_ANSWERS = True
        else:
            url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
            try:
                socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
                _HUB_ANSWERS = True
            except OSError:
                _HUB_ANSWERS = False
    return _HUB_ANSWERS


def hub_kwargs(name: str) -> dict:
    """from_pretrained keywords for ``name``: cache only when it is a hub id and the hub does not answer."""
    if Path(name).expanduser().exists() or hub_reachable():
        return {}
    return {"local_files_only": True}
