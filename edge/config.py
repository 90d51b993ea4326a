"""Edge configuration and the API-key file. Pure: no asyncio, no websockets.

The key file is JSON Lines: one JSON object per line, blank lines and lines starting with ``#``
ignored. Keys are never stored in clear; each entry holds the SHA-256 hex digest of the key::

    {"sha256": "9f86d0...", "tenant": "acme", "tier": 1, "requests_per_min": 60,
     "tokens_per_min": 200000, "max_streams": 8, "weight": 2}

``admin`` (default false) lets a key load and unload LoRA adapters at run time
(``POST /v1/load_lora_adapter``, docs/lora.md); in dev mode (no key file) anyone may.

``tier`` (0, 1 or 2) picks the priority topic. ``weight`` (default 1, in [0.01, 1000]) is the
tenant's fair share within its tier at the workers (docs/worker.md, "Fair share"): carried on every
request as ``InferenceRequest.weight``. The limits are optional (defaults below; ``0`` means
unlimited). ``lockgate keys add --tenant acme --tier 1 --keys keys.jsonl`` makes a random key,
appends its hashed entry and prints the key once.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from bus import MAX_WEIGHT, MIN_WEIGHT, Tier, TopicLayout

DEFAULT_REQUESTS_PER_MIN = 120
DEFAULT_TOKENS_PER_MIN = 500_000
DEFAULT_MAX_STREAMS = 16
KEY_PREFIX = "lg-"


class ConfigError(ValueError):
    """A bad configuration value or key file; the message names the file, line and field."""


def hash_key(key: str) -> str:
    """The stored form of an API key: SHA-256 hex of its UTF-8 bytes."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    """A fresh random API key (URL- and subprotocol-safe: ``[A-Za-z0-9_-]``)."""
    return KEY_PREFIX + secrets.token_urlsafe(24)


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """What one API key grants. ``0`` in a limit means unlimited."""

    key_hash: str
    tenant: str
    tier: int = int(Tier.P1)
    requests_per_min: int = DEFAULT_REQUESTS_PER_MIN
    tokens_per_min: int = DEFAULT_TOKENS_PER_MIN
    max_streams: int = DEFAULT_MAX_STREAMS
    weight: float = 1.0  # fair share within the tier, at the workers
    admin: bool = False  # may load and unload LoRA adapters (docs/lora.md)

    def __post_init__(self) -> None:
        if not isinstance(self.key_hash, str) or len(self.key_hash) != 64 or any(
            c not in "0123456789abcdef" for c in self.key_hash
        ):
            raise ConfigError("sha256 must be 64 lowercase hex characters")
        if not isinstance(self.tenant, str) or not self.tenant or len(self.tenant) > 128:
            raise ConfigError("tenant must be a non-empty string of at most 128 characters")
        if isinstance(self.tier, bool) or self.tier not in tuple(int(t) for t in Tier):
            raise ConfigError(f"tier must be one of {[int(t) for t in Tier]}, got {self.tier!r}")
        for name in ("requests_per_min", "tokens_per_min", "max_streams"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {v!r}")
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not MIN_WEIGHT <= w <= MAX_WEIGHT:
            raise ConfigError(f"weight must be a number in [{MIN_WEIGHT}, {MAX_WEIGHT}], got {w!r}")
        object.__setattr__(self, "weight", float(w))
        if not isinstance(self.admin, bool):
            raise ConfigError(f"admin must be true or false, got {self.admin!r}")

    def to_json(self) -> str:
        return json.dumps(
            ({"admin": True} if self.admin else {}) | {
                "sha256": self.key_hash,
                "tenant": self.tenant,
                "tier": self.tier,
                "requests_per_min": self.requests_per_min,
                "tokens_per_min": self.tokens_per_min,
                "max_streams": self.max_streams,
                "weight": self.weight,
            }
        )


_ENTRY_FIELDS = {"sha256", "tenant", "tier", "requests_per_min", "tokens_per_min", "max_streams", "weight", "admin"}


def parse_keys(text: str, source: str = "<keys>") -> dict[str, KeyEntry]:
    """Parse a key file's text into ``{sha256: entry}``. Raises :class:`ConfigError` naming the line."""
    out: dict[str, KeyEntry] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{where}: expected a JSON object")
        unknown = set(obj) - _ENTRY_FIELDS
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}")
        if "sha256" not in obj or "tenant" not in obj:
            raise ConfigError(f"{where}: sha256 and tenant are required")
        try:
            entry = KeyEntry(
                key_hash=obj["sha256"],
                tenant=obj["tenant"],
                tier=obj.get("tier", int(Tier.P1)),
                requests_per_min=obj.get("requests_per_min", DEFAULT_REQUESTS_PER_MIN),
                tokens_per_min=obj.get("tokens_per_min", DEFAULT_TOKENS_PER_MIN),
                max_streams=obj.get("max_streams", DEFAULT_MAX_STREAMS),
                weight=obj.get("weight", 1.0),
                admin=obj.get("admin", False),
            )
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        if entry.key_hash in out:
            raise ConfigError(f"{where}: duplicate key (same sha256 as an earlier line)")
        out[entry.key_hash] = entry
    return out


def load_keys(path: str | Path) -> dict[str, KeyEntry]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read key file {p}: {exc.strerror or exc}") from None
    return parse_keys(text, str(p))


def add_key(path: str | Path | None, tenant: str, tier: int = int(Tier.P1), weight: float = 1.0,
            admin: bool = False, **limits: int) -> tuple[str, KeyEntry]:
    """Make a new key; append its hashed entry to ``path`` (when given). Returns (clear key, entry)."""
    key = new_key()
    entry = KeyEntry(hash_key(key), tenant, tier, weight=weight, admin=admin, **limits)
    if path is not None:
        p = Path(path)
        if p.exists():
            load_keys(p)  # refuse to append to a broken file
        with p.open("a", encoding="utf-8") as f:
            f.write(entry.to_json() + "\n")
    return key, entry


@dataclass(frozen=True, slots=True)
class EdgeConfig:
    """Everything an :class:`~edge.server.Edge` needs besides the bus.

    ``keys is None`` is dev mode: every connection is admitted (with or without a key) as tenant
    ``dev`` on ``dev_tier``. ``slo_wait_s[t]`` is the longest estimated queue wait tier ``t`` may
    see before new requests are shed. Sizes are bytes, times seconds.
    """

    model: str  # the served model name (topic names, `model` field check)
    model_path: str | None = None  # local HF folder with the tokenizer; None = the caller passes one
    host: str = "127.0.0.1"
    port: int = 8765
    # SO_REUSEPORT: several edge processes listen on one port and the kernel spreads new
    # connections over them (one event loop is one core; this is how an edge uses more cores)
    reuse_port: bool = False
    # the OpenAI-compatible HTTP API's port (same host); None = not served, 0 = any free port
    openai_port: int | None = None
    # the tool-call format of /v1/chat/completions (edge.chat.tool_parsers: hermes, llama3_json, mistral);
    # None = the served model's (by its name)
    tool_call_parser: str | None = None
    # the reasoning format of the OpenAI API (edge.reasoning: deepseek_r1, qwen3): <think>...</think>
    # becomes reasoning_content (chat) and reasoning items (Responses); None = off
    reasoning_parser: str | None = None
    # /v1/embeddings' pooling when a request names none: "last" (the last prompt token's final
    # state) or "mean" (every prompt token's); the edge stamps it on each request, so every worker
    # computes the same kind of vector for the model
    embedding_pooling: str = "last"
    # LoRA adapters a request's ``model`` may name (routed as ``model`` with ``lora=<name>``), beside
    # those the live workers' heartbeats list (docs/lora.md); names only, the workers load them
    lora_modules: tuple[str, ...] = ()
    # the Files and Batches API (docs/protocol.md, "Files and batches"): the largest upload (OpenAI's
    # batch input limit; stored chunked on the bus, so Kafka's record limit does not cap it), and
    # how many lines of one batch run at once (they share the key's max_streams with its live calls)
    max_file_bytes: int = 200 * 1024 * 1024
    batch_max_in_flight: int = 8
    # how long POST /v1/load_lora_adapter waits for every live worker of the model to answer
    lora_load_timeout_s: float = 30.0
    # more base models behind this edge (docs/lora.md, "Several base models"): name -> the local
    # folder with its tokenizer, loaded on the first request that names it. A model some live
    # worker's heartbeat names is served too when a folder is known for it here
    models: tuple[tuple[str, str], ...] = ()
    edge_id: str = field(default_factory=lambda: "edge-" + secrets.token_hex(4))
    layout: TopicLayout = field(default_factory=TopicLayout)
    keys: dict[str, KeyEntry] | None = None
    dev_tier: int = int(Tier.P1)
    # admission
    max_frame_bytes: int = 1 << 20
    max_streams_per_connection: int = 64
    max_connections: int = 100_000
    # open WebSocket connections one API key may hold (idle or not); 0 = unlimited. Dev mode has
    # one shared principal, so the limit applies only with a key file
    max_connections_per_key: int = 256
    # the longest a structured-output constraint may take to compile at admission; longer is a 400
    # (the compile finishes in the background and is cached, so the limit is not a retry loop)
    grammar_compile_timeout_s: float = 5.0
    default_max_tokens: int = 256
    # the longest the edge waits for the bus to acknowledge a request's write; past it (the broker
    # down or unreachable) the client gets a 503 naming the bus, not a hang
    publish_timeout_s: float = 5.0
    request_timeout_s: float = 300.0  # deadline on the bus; the edge gives up (error expired) after it
    # prefix-affine partitioning (edge/admission/affinity.py; docs/design.md): same tenant + same prompt prefix
    # -> same partition (worker, prefix cache), hot prefixes spread; False: by request id
    prefix_affinity: bool = True
    affinity_tokens: int = 64  # the prompt prefix keyed on when there is no system message
    # stored responses, shared by the fleet on the bus table <ns>.table.responses (docs/protocol.md,
    # "Resuming a stream"): kept this long (the topic's retention; a stream resumes while its reply
    # topic still holds its replies too), at most this many in each edge's view, each at most this big
    responses_retention_s: float = 3600.0
    responses_max_stored: int = 100_000
    responses_max_bytes: int = 1_000_000
    responses_view_bytes: int = 256 << 20  # the memory each edge's view of them may take
    # load shedding
    slo_wait_s: tuple[float, ...] = (2.0, 5.0, 60.0)  # one per tier: checked in __post_init__
    max_queue_depth: tuple[int, int, int] = (0, 0, 0)  # per tier, 0 = no depth limit
    # per tier, the time-to-first-token target in ms (the workers' --slo-ttft-ms): a request whose
    # tier's predicted wait (the heartbeats' est_wait_s) already passes it is refused early (503 +
    # Retry-After) rather than queued to miss it, or, with ``slo_demote``, queued on the first lower
    # tier that can meet its own target
    slo_ttft_ms: tuple[float, ...] = (500.0, 2000.0, 30000.0)
    slo_demote: bool = False
    heartbeat_stale_s: float = 3.0
    # fleet-wide key limits (edge/admission/fleet.py, docs/protocol.md "Fleet-wide limits"): the
    # edges split each key's limits by the heartbeats they publish on <ns>.edges every
    # fleet_sync_interval_s; a peer silent for fleet_edge_stale_s (on the bus's clock) is dead, and
    # an edge that has not read its own heartbeat back for half as long refuses limited keys (503).
    # False: each edge enforces every key's whole limits (N edges: up to N x). Off in dev mode.
    fleet_limits: bool = True
    fleet_sync_interval_s: float = 0.5
    fleet_edge_stale_s: float = 3.0
    # slow clients
    send_queue_frames: int = 1024
    slow_client_grace_s: float = 5.0
    # websockets
    ping_interval_s: float | None = 20.0
    ping_timeout_s: float | None = 20.0
    close_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("model must be a non-empty name")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if self.openai_port is not None and not 0 <= self.openai_port <= 65535:
            raise ConfigError(f"openai_port must be in 0..65535, got {self.openai_port}")
        if self.tool_call_parser is not None and self.tool_call_parser not in ("hermes", "llama3_json", "mistral"):
            raise ConfigError(f"tool_call_parser must be hermes, llama3_json or mistral, got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in ("deepseek_r1", "qwen3"):
            raise ConfigError(f"reasoning_parser must be deepseek_r1 or qwen3, got {self.reasoning_parser!r}")
        if self.embedding_pooling not in ("last", "mean"):
            raise ConfigError(f"embedding_pooling must be last or mean, got {self.embedding_pooling!r}")
        if self.dev_tier not in tuple(int(t) for t in Tier):
            raise ConfigError(f"dev_tier must be one of {[int(t) for t in Tier]}")
        for name in ("max_frame_bytes", "max_streams_per_connection", "max_connections", "send_queue_frames",
                     "default_max_tokens", "affinity_tokens", "max_file_bytes", "batch_max_in_flight"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if len(self.slo_wait_s) != len(Tier) or any(s <= 0 for s in self.slo_wait_s):
            raise ConfigError(f"slo_wait_s needs {len(Tier)} positive values (one per tier)")
        if len(self.slo_ttft_ms) != len(Tier) or not all(s > 0 for s in self.slo_ttft_ms):
            raise ConfigError(f"slo_ttft_ms needs {len(Tier)} values > 0 (one per tier)")
        if len(self.max_queue_depth) != len(Tier) or any(d < 0 for d in self.max_queue_depth):
            raise ConfigError(f"max_queue_depth needs {len(Tier)} values >= 0 (one per tier)")
        if self.responses_view_bytes < self.responses_max_bytes:
            raise ConfigError(f"responses_view_bytes ({self.responses_view_bytes}) must be >= responses_max_bytes "
                              f"({self.responses_max_bytes})")
        if not self.responses_retention_s > 0 or self.responses_max_stored < 1 or self.responses_max_bytes < 1024:
            raise ConfigError("responses_retention_s must be > 0, responses_max_stored >= 1 and responses_max_bytes "
                              f">= 1024, got {self.responses_retention_s}, {self.responses_max_stored}, "
                              f"{self.responses_max_bytes}")
        if self.max_connections_per_key < 0:
            raise ConfigError(f"max_connections_per_key must be >= 0, got {self.max_connections_per_key}")
        if not self.lora_load_timeout_s > 0:
            raise ConfigError(f"lora_load_timeout_s must be > 0, got {self.lora_load_timeout_s}")
        for name, path in self.models:
            if not name or not path or name == self.model:
                raise ConfigError(f"models: each entry needs a name other than {self.model!r} and a tokenizer folder")
        if not self.publish_timeout_s > 0:
            raise ConfigError(f"publish_timeout_s must be > 0, got {self.publish_timeout_s}")
        if not self.grammar_compile_timeout_s > 0:
            raise ConfigError(f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")
        if not (0 < self.fleet_sync_interval_s and self.fleet_edge_stale_s >= 4 * self.fleet_sync_interval_s):
            raise ConfigError(f"fleet_sync_interval_s must be > 0 and fleet_edge_stale_s at least 4 times it, got "
                              f"{self.fleet_sync_interval_s} and {self.fleet_edge_stale_s}")
        if self.heartbeat_stale_s <= 0 or self.request_timeout_s <= 0 or self.slow_client_grace_s < 0:
            raise ConfigError("heartbeat_stale_s and request_timeout_s must be > 0, slow_client_grace_s >= 0")

    @property
    def dev_mode(self) -> bool:
        return self.keys is None
