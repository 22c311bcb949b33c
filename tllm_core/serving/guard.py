"""What guards tllm's server routes (``/tllm/*``): API keys, client scopes, hidden paths."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import re
import secrets
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from tllm_core.api.request_settings import GROUP_KEY, OWN_GROUP

TLLM_PREFIX = "/tllm"
HIDDEN = "<hidden>"
# Keys whose string values are filesystem paths (consumer results: export/sae "out", sae "path").
_PATH_KEY = re.compile(r"(?s)path|out|dir|.*_path|.*_dir")
# An absolute POSIX path inside any text (tracebacks, error messages): "/" not preceded by a
# word character, so "top-k/top-p" or "1/0" are left alone.
_ABS_PATH = re.compile(r"(?<![\w./:-])/[^\s'\"()<>,;:]+")


def hide_paths(value: Any) -> Any:
    """``value`` (JSON-like) with path-valued keys and absolute paths in strings hidden."""
    if isinstance(value, dict):
        return {
            k: HIDDEN if isinstance(v, str) and _PATH_KEY.fullmatch(str(k)) else hide_paths(v)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [hide_paths(v) for v in value]
    if isinstance(value, str):
        return _ABS_PATH.sub(HIDDEN, value)
    return value


@contextlib.contextmanager
def bound(var: ContextVar, value: Any) -> Iterator[None]:
    """``var`` set to ``value`` inside (in this task's context)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


# The client of the HTTP request being handled (set by ClientScope, read where vLLM admits the
# request: the same asyncio task, or a task it started, which copies the context).
CLIENT: ContextVar[str] = ContextVar("tllm_client", default="anon")


def _authorization(headers: list[tuple[bytes, bytes]]) -> bytes:
    return next((v for k, v in headers if k.lower() == b"authorization"), b"")


def scoped_group(extra: dict[str, Any], client: str, request_id: str) -> str:
    """A client's ``tllm_group`` inside its own namespace, else the request's own group."""
    group = extra.get(GROUP_KEY)
    return f"client-{client}/{group}" if group is not None else f"{OWN_GROUP}{request_id}"


class ClientScope:
    """Pure ASGI middleware: sets :data:`CLIENT` for the request it passes on (a short keyed
    digest of its ``Authorization`` header, ``anon`` without one)."""

    def __init__(self, app: Any, secret: bytes):
        self.app = app
        self.secret = secret

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        key = _authorization(scope["headers"])
        client = hmac.new(self.secret, key, "sha256").hexdigest()[:12] if key else "anon"
        with bound(CLIENT, client):
            await self.app(scope, receive, send)


class BearerGuard:
    """Pure ASGI middleware: HTTP 401 on ``/tllm/*`` without ``Authorization: Bearer KEY``
    (any of ``tokens``, compared in constant time; no tokens: nothing guarded)."""

    def __init__(self, app: Any, tokens: list[str]):
        self.app = app
        self.digests = [hashlib.sha256(t.encode()).digest() for t in tokens]

    def allowed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        scheme, _, token = _authorization(headers).decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode()).digest()
        # A list, not a generator: every key is compared, so the time does not tell which matched.
        return any([secrets.compare_digest(digest, d) for d in self.digests])

    async def __call__(self, scope, receive, send):
        if not self.digests or scope["type"] != "http":  # tllm has no websocket route
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        guarded = path == TLLM_PREFIX or path.startswith(TLLM_PREFIX + "/")
        if not guarded or scope.get("method") == "OPTIONS" or self.allowed(scope["headers"]):
            return await self.app(scope, receive, send)
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send_json(send, 401, body, (b"www-authenticate", b"Bearer"))


async def send_json(send: Any, status: int, payload: bytes, *headers: tuple[bytes, bytes]) -> None:
    """An ASGI JSON response."""
    length = (b"content-length", str(len(payload)).encode())
    start = [(b"content-type", b"application/json"), length, *headers]
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": payload})
