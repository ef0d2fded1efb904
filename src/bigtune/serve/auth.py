"""API tokens: made random, stored as their SHA-256 digest only, compared in constant time.

A token is shown once, when it is made (``bigtune serve token add USER``); the database keeps its digest, so a
copy of the database gives nobody a token. Tokens never reach a log: the service logs user names and job ids.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

PREFIX = "btk_"  # says what the string is when one turns up in a shell history or a config file


def new_token() -> str:
    """A fresh random token (256 bits)."""
    return PREFIX + secrets.token_urlsafe(32)


def token_digest(token: str) -> str:
    """The stored form of a token: its SHA-256, hex."""
    return hashlib.sha256(token.encode()).hexdigest()


def same_digest(token: str, digest: str) -> bool:
    """Whether ``token`` hashes to ``digest``, in time that does not depend on where they differ."""
    return hmac.compare_digest(token_digest(token), digest)


def bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()
