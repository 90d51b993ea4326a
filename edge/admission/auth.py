"""Who is connecting: the API key from the WebSocket handshake, checked against the hashed key file.

The key may travel (first match wins):

1. ``Authorization: Bearer <key>`` header — programs;
2. the ``Sec-WebSocket-Protocol`` header, offered as ``lockgate.v1, bearer.<key>`` — browsers, which
   cannot set headers on a WebSocket; the server answers with ``lockgate.v1`` only, so the key is
   never echoed;
3. the ``api_key`` query parameter (``/ws?api_key=<key>``) — convenient, but URLs end up in logs
   and proxies: prefer 1 or 2.

Pure: no I/O. Comparison is by SHA-256 digest lookup, so timing does not leak key prefixes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import parse_qsl, urlsplit

from websockets.typing import Subprotocol

from edge.config import KeyEntry, hash_key

SUBPROTOCOL = "lockgate.v1"
BEARER_PROTOCOL_PREFIX = "bearer."
DEV_TENANT = "dev"


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated connection: its tenant, tier and limits (``entry``). ``tier_override``:
    work the key submits at another tier than its own (a batch's lines run at p2); the key's
    limits (``entry``, keyed by its hash) stay the same."""

    entry: KeyEntry
    tier_override: int | None = None

    @property
    def tenant(self) -> str:
        return self.entry.tenant

    @property
    def tier(self) -> int:
        return self.entry.tier if self.tier_override is None else self.tier_override


class AuthError(Exception):
    """Handshake refused with HTTP 401; the message says why (never echoes the key)."""


class HeaderLookup(Protocol):
    """What :func:`extract_key` reads of a handshake's headers (websockets' ``Headers``, a dict)."""

    def get(self, key: str, /) -> str | None: ...


def extract_key(path: str, headers: HeaderLookup) -> str | None:
    """The API key offered by a handshake, or ``None``. ``headers`` needs ``.get(name)``
    (and ``get_all`` for repeated headers, as websockets' ``Headers`` has)."""
    auth = headers.get("Authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    get_all = getattr(headers, "get_all", None)
    protos = get_all("Sec-WebSocket-Protocol") if get_all else [headers.get("Sec-WebSocket-Protocol") or ""]
    for line in protos:
        for proto in line.split(","):
            proto = proto.strip()
            if proto.startswith(BEARER_PROTOCOL_PREFIX) and len(proto) > len(BEARER_PROTOCOL_PREFIX):
                return proto[len(BEARER_PROTOCOL_PREFIX):]
    query = urlsplit(path).query
    if query:
        for name, value in parse_qsl(query, keep_blank_values=True):
            if name == "api_key" and value:
                return value
    return None


class Authenticator:
    """Maps keys to principals. ``keys is None`` = dev mode: everyone is tenant ``dev`` on ``dev_tier``."""

    def __init__(self, keys: Mapping[str, KeyEntry] | None, dev_tier: int = 1) -> None:
        self._keys = keys
        self._dev = Principal(KeyEntry("0" * 64, DEV_TENANT, dev_tier, 0, 0, 0))

    @property
    def dev_mode(self) -> bool:
        return self._keys is None

    def authenticate(self, key: str | None) -> Principal:
        if self._keys is None:
            return self._dev
        if not key:
            raise AuthError("missing API key: send 'Authorization: Bearer <key>', "
                            "subprotocol 'bearer.<key>' or ?api_key=<key>")
        entry = self._keys.get(hash_key(key))
        if entry is None:
            raise AuthError("invalid API key")
        return Principal(entry)

    def by_hash(self, key_hash: str) -> Principal | None:
        """The principal of a key known by its stored hash (work submitted earlier and resumed
        later, a batch after an edge restart); ``None`` when the key is no longer in the key file.
        In dev mode every hash is the dev principal."""
        if self._keys is None:
            return self._dev
        entry = self._keys.get(key_hash)
        return Principal(entry) if entry is not None else None


def select_subprotocol(offered: Sequence[str]) -> Subprotocol | None:
    """The subprotocol to answer: ``lockgate.v1`` when offered, none otherwise (``bearer.*`` is
    never echoed). A browser that offered ``bearer.<key>`` must also offer ``lockgate.v1``."""
    return Subprotocol(SUBPROTOCOL) if SUBPROTOCOL in offered else None
