"""How lockgate's Kafka clients authenticate and encrypt: TLS and SASL through aiokafka's own options.

One :class:`KafkaSecurity` per bus, handed to every client the bus creates (producer, admin client,
group and group-less consumers, the partition reader), so no client can connect in the clear while
another authenticates.

Where the settings come from (:func:`security_from`), first found wins:

1. keyword arguments of :func:`bus.connect`;
2. the bus URL's query: ``kafka://b1:9093?security_protocol=SASL_SSL&sasl_mechanism=SCRAM-SHA-512
   &sasl_username=lockgate&ssl_cafile=/etc/kafka-ca/ca.crt``;
3. environment variables ``LOCKGATE_KAFKA_<OPTION>`` (``LOCKGATE_KAFKA_SECURITY_PROTOCOL``, ...).

The password is never taken from the URL (a URL shows up in process lists, logs and ``--help``
defaults): it comes from ``LOCKGATE_KAFKA_SASL_PASSWORD`` or from a file named by
``sasl_password_file`` (URL or ``LOCKGATE_KAFKA_SASL_PASSWORD_FILE``; a mounted Kubernetes Secret).

Invariants checked at construction (``ValueError`` naming the option and the value):
``security_protocol`` is one of :data:`PROTOCOLS`; ``sasl_mechanism`` is one of :data:`MECHANISMS`
and only set with a SASL protocol; a SASL protocol has a username and a password; TLS files are
only given with a TLS protocol and are readable. Pure except for reading the files it is told to.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
ENV_PREFIX = "LOCKGATE_KAFKA_"

# Options a bus URL's query may carry (name -> parser); the password is deliberately absent.
URL_OPTIONS: dict[str, type] = {
    "security_protocol": str,
    "sasl_mechanism": str,
    "sasl_username": str,
    "sasl_password_file": str,
    "ssl_cafile": str,
    "ssl_certfile": str,
    "ssl_keyfile": str,
    "ssl_check_hostname": str,
}
# Options only a keyword argument or the environment may give.
SECRET_OPTIONS = ("sasl_password",)


def _tls(protocol: str) -> bool:
    return protocol in ("SSL", "SASL_SSL")


def _sasl(protocol: str) -> bool:
    return protocol.startswith("SASL_")


def _flag(name: str, raw: str | bool) -> bool:
    if isinstance(raw, bool):
        return raw
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"Kafka option {name}={raw!r} is not a boolean (true/false)")


def _readable(name: str, path: str) -> str:
    if not Path(path).is_file() or not os.access(path, os.R_OK):
        raise ValueError(f"Kafka option {name}: no readable file at {path!r}")
    return path


@dataclass(frozen=True, slots=True)
class KafkaSecurity:
    """The security settings of one bus; see the module docstring. ``PLAINTEXT`` by default."""

    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None  # None with a SASL protocol: PLAIN, aiokafka's default
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_check_hostname: bool = True

    def __post_init__(self) -> None:
        proto = self.security_protocol
        if proto not in PROTOCOLS:
            raise ValueError(f"Kafka security_protocol {proto!r} is not supported (use one of {', '.join(PROTOCOLS)})")
        mech = self.sasl_mechanism
        if mech is not None and mech not in MECHANISMS:
            raise ValueError(f"Kafka sasl_mechanism {mech!r} is not supported (use one of {', '.join(MECHANISMS)})")
        if _sasl(proto):
            if not self.sasl_username:
                raise ValueError(f"Kafka security_protocol {proto} needs sasl_username")
            if not self.sasl_password:
                raise ValueError(f"Kafka security_protocol {proto} needs a password: set "
                                 f"{ENV_PREFIX}SASL_PASSWORD or sasl_password_file")
        else:
            for name in ("sasl_mechanism", "sasl_username", "sasl_password"):
                if getattr(self, name) is not None:
                    raise ValueError(f"Kafka option {name} needs a SASL security_protocol "
                                     f"(SASL_SSL or SASL_PLAINTEXT), got {proto}")
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            path = getattr(self, name)
            if path is None:
                continue
            if not _tls(proto):
                raise ValueError(f"Kafka option {name} needs a TLS security_protocol (SSL or SASL_SSL), got {proto}")
            _readable(name, path)
        if not self.ssl_check_hostname and not _tls(proto):
            raise ValueError(f"Kafka option ssl_check_hostname needs a TLS security_protocol (SSL or SASL_SSL), got {proto}")
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ValueError("Kafka option ssl_keyfile needs ssl_certfile (the client certificate)")

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client TLS context for a TLS protocol (the given CA, else the system's; the client
        certificate when given); ``None`` for PLAINTEXT and SASL_PLAINTEXT."""
        if not _tls(self.security_protocol):
            return None
        from aiokafka.helpers import create_ssl_context

        try:
            ctx = create_ssl_context(cafile=self.ssl_cafile, certfile=self.ssl_certfile, keyfile=self.ssl_keyfile)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"Kafka TLS files could not be loaded (ssl_cafile={self.ssl_cafile!r}, "
                             f"ssl_certfile={self.ssl_certfile!r}): {exc}") from exc
        if self.ssl_cafile is None:
            ctx.load_default_certs()
        ctx.check_hostname = self.ssl_check_hostname
        return ctx

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for every aiokafka client (producer, consumer, admin): only the ones
        that differ from aiokafka's PLAINTEXT defaults, so a plain bus passes none."""
        if self.security_protocol == "PLAINTEXT":
            return {}
        kw: dict[str, Any] = {"security_protocol": self.security_protocol}
        ctx = self.ssl_context()
        if ctx is not None:
            kw["ssl_context"] = ctx
        if _sasl(self.security_protocol):
            kw["sasl_mechanism"] = self.sasl_mechanism or "PLAIN"
            kw["sasl_plain_username"] = self.sasl_username
            kw["sasl_plain_password"] = self.sasl_password
        return kw

    def describe(self) -> str:
        """For logs and errors: the protocol and mechanism, never the password."""
        if _sasl(self.security_protocol):
            return f"{self.security_protocol}/{self.sasl_mechanism or 'PLAIN'} as {self.sasl_username}"
        return self.security_protocol


def security_from(url_options: Mapping[str, Any], env: Mapping[str, str]) -> KafkaSecurity:
    """The :class:`KafkaSecurity` of a bus from its URL options and keywords (``url_options``,
    already merged, keywords winning) and the environment (``env``, the fallback)."""
    def get(name: str) -> Any:
        if name in url_options and url_options[name] not in (None, ""):
            return url_options[name]
        raw = env.get(ENV_PREFIX + name.upper(), "")
        return raw if raw != "" else None

    proto = (get("security_protocol") or "PLAINTEXT").strip().upper()
    mech = get("sasl_mechanism")
    password = get("sasl_password")
    password_file = get("sasl_password_file")
    if password is None and password_file is not None:
        try:
            password = Path(password_file).read_text().rstrip("\r\n")
        except OSError as exc:
            raise ValueError(f"Kafka option sasl_password_file: cannot read {password_file!r} ({exc.strerror})") from None
    hostname = get("ssl_check_hostname")
    return KafkaSecurity(
        security_protocol=proto,
        sasl_mechanism=mech.strip().upper() if isinstance(mech, str) else mech,
        sasl_username=get("sasl_username"),
        sasl_password=password,
        ssl_cafile=get("ssl_cafile"),
        ssl_certfile=get("ssl_certfile"),
        ssl_keyfile=get("ssl_keyfile"),
        ssl_check_hostname=True if hostname is None else _flag("ssl_check_hostname", hostname),
    )
