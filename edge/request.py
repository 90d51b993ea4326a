"""The request both front ends admit: :class:`Generate`, the refusal :class:`ProtocolError`, and the
prompt tokenizer :class:`PromptEncoder`.

The WebSocket protocol (:mod:`edge.ws.protocol`) and the OpenAI API (:mod:`edge.openai.schema`) each
parse their own wire format into a :class:`Generate`; admission (:mod:`edge.admission`) takes it from
there. Protocol-neutral: nothing here knows a frame or an HTTP body.
"""

from __future__ import annotations

from dataclasses import dataclass

from bus import ChatMessage, ErrorCode, SamplingParams
from tokenization.prompts import PromptTokenizer

MAX_ID_LEN = 128
MAX_MESSAGES = 512
MAX_CACHE_SALT = 256


class ProtocolError(Exception):
    """A frame the server refuses. Becomes ``{"type": "error", ...}`` for the client."""

    def __init__(self, message: str, field: str | None = None, id: str | None = None,
                 code: str = ErrorCode.INVALID_REQUEST, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.id = id
        self.code = code
        self.retry_after = retry_after


@dataclass(frozen=True, slots=True)
class Generate:
    id: str  # the client's id for this request, unique among its in-flight requests on the connection
    sampling: SamplingParams
    messages: tuple[ChatMessage, ...] | None = None
    prompt: str | None = None
    model: str | None = None
    max_tokens_given: bool = False
    token_ids: bool = False  # echo token ids in each delta
    prompt_token_ids: tuple[int, ...] | None = None  # a pre-tokenized prompt (OpenAI completions)
    cache_salt: str | None = None  # a prefix-cache namespace within the tenant's (vLLM's cache_salt)
    # runs on when its client goes away, for a resume on any edge (edge.admission.resumable)
    resumable: bool = False
    # the tier the client asks for (``priority`` / ``service_tier``, :func:`requested_tier`); the
    # edge grants it within its key's maximum tier; None: the key's tier
    tier: int | None = None


# --- tokenization -------------------------------------------------------------------------------

class PromptEncoder(PromptTokenizer):
    """The served model's :class:`~tokenization.prompts.PromptTokenizer`, raising the edge's
    :class:`ProtocolError`.

    ``encode`` is CPU-bound (a few ms for long prompts); callers run big prompts in a thread.
    HF fast tokenizers are thread-safe for encoding.
    """

    def encode(self, frame: Generate) -> list[int]:
        """Token ids of the prompt. Raises :class:`ProtocolError` (field ``messages``/``prompt``)
        when the template fails or the prompt does not fit the context."""
        field = "messages" if frame.messages is not None else "prompt"
        if frame.prompt_token_ids is not None:
            ids = list(frame.prompt_token_ids)
            vocab = len(self.tokenizer)
            if any(t >= vocab for t in ids):
                raise ProtocolError(f"prompt token ids must be below the vocabulary size {vocab}", field, frame.id)
        else:
            try:
                ids = self.chat_ids(frame.messages) if frame.messages is not None else self.text_ids(frame.prompt or "")
            except Exception as exc:  # template/tokenizer errors are the input's fault
                raise ProtocolError(f"cannot tokenize {field}: {str(exc)[:200]}", field, frame.id) from None
        if not ids:
            raise ProtocolError(f"{field} tokenizes to nothing", field, frame.id)
        if len(ids) >= self.context_len:
            raise ProtocolError(
                f"{field} is {len(ids)} tokens; the model's context is {self.context_len} "
                f"(prompt must leave room for at least one output token)", field, frame.id)
        return ids


# --- a request's tier ---------------------------------------------------------------------------

# OpenAI's service_tier values: "priority" asks for the most urgent tier, "flex" for batch-like
# service; "auto" and "default" leave the key's own tier
SERVICE_TIERS = {"auto": None, "default": None, "priority": 0, "flex": 2}


def requested_tier(obj: dict, frame_id: str | None = None) -> int | None:
    """The tier a request body asks for: vLLM's ``priority`` (an integer 0..2, lower = more urgent:
    the tier itself) or OpenAI's ``service_tier`` (``auto``/``default``: the key's tier,
    ``priority``: p0, ``flex``: p2); None when it names none. The edge grants the less urgent of
    it and the key's tier (a key's tier is the most urgent its requests may have), so a key may
    always send background work at p2. Raises :class:`ProtocolError` naming the field."""
    prio, service = obj.get("priority"), obj.get("service_tier")
    if prio is not None and service is not None:
        raise ProtocolError("priority and service_tier both set; name the tier once", "priority", frame_id)
    if prio is not None:
        if isinstance(prio, bool) or not isinstance(prio, int) or not 0 <= prio <= 2:
            raise ProtocolError(f"priority must be an integer tier 0, 1 or 2 (0 = most urgent), got {prio!r}"[:200],
                                "priority", frame_id)
        return prio
    if service is not None:
        if not isinstance(service, str) or service not in SERVICE_TIERS:
            raise ProtocolError(f"service_tier must be one of {sorted(SERVICE_TIERS)}, got {service!r}"[:200],
                                "service_tier", frame_id)
        return SERVICE_TIERS[service]
    return None
