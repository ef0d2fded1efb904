"""The service's web page (GET /): one self-contained HTML file, assets/serve_page.html, with its script and style
inline and nothing fetched from elsewhere (the cluster's machines may have no internet). It reads the JSON API with
the token the user types, kept in the tab's sessionStorage, and draws its plots as SVG.

Served with a Content-Security-Policy that allows only that inline script and style (by their SHA-256) and requests
to the service itself: a job's name or log cannot run as script, and the page cannot send the token elsewhere.
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import lru_cache
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "assets" / "serve_page.html"


def _digest(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@lru_cache(maxsize=1)
def page() -> tuple[str, dict[str, str]]:
    """The page's HTML and the headers it is served with."""
    html = PAGE.read_text()
    scripts = [_digest(s) for s in re.findall(r"<script>(.*?)</script>", html, re.S)]
    styles = [_digest(s) for s in re.findall(r"<style>(.*?)</style>", html, re.S)]
    policy = (
        f"default-src 'none'; script-src {' '.join(scripts)}; style-src {' '.join(styles)}; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    headers = {
        "Content-Security-Policy": policy,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",
    }
    return html, headers
