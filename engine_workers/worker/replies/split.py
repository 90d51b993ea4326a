"""Reply records under the producer's size limit. Pure (no asyncio, no bus).

A reply round coalesces everything queued for one reply partition into one record. While the bus
lags, a round can hold many steps' tokens of many requests; with ``logprobs`` (20 alternatives a
token: ~0.5 KB) that passes Kafka's ``max.request.size`` (1 MiB) within a couple of thousand
tokens, and a record over it is refused on every retry (aiokafka: ``MessageSizeTooLargeError``).
So a round's record over the limit is split, in order: the list of messages in halves (a
request's chunk stays before its final: the messages are in the order chunks, then finals), and a
lone chunk too large by itself in halves at the boundaries of the engine steps that queued it
(``calls``: tokens and text characters per step), each half with its own ``seq``/``text_offset``.
The records of a partition are then sent one after the other, so a consumer reading them in
order (``replies_of``) sees exactly what one record would have said. A request still appears at
most once among a record's chunks and once among its finals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from bus import Error, Finished, ReplyBatch, TokenChunk, encode

# Bytes kept free under the producer's limit for the record's key, headers and batch framing
# (aiokafka counts them: ``DefaultRecordBatchBuilder.estimate_size_in_bytes``; ~80 bytes + key).
RECORD_OVERHEAD = 1024

Calls = tuple[tuple[int, int], ...]  # per engine step that queued tokens: (tokens, text characters)


@dataclass(frozen=True, slots=True)
class Piece:
    """One message of a round; ``calls`` only for a chunk (how it may be split)."""

    msg: TokenChunk | Finished | Error
    calls: Calls = ()


def encode_replies(msgs: Sequence[TokenChunk | Finished | Error]) -> bytes:
    """One record's value: a lone message as itself, else a :class:`ReplyBatch` (chunks, then
    ``Finished``, then ``Error``)."""
    if len(msgs) == 1:
        return encode(msgs[0])
    return encode(ReplyBatch(tuple(m for m in msgs if isinstance(m, TokenChunk)),
                             tuple(m for m in msgs if isinstance(m, Finished)),
                             tuple(m for m in msgs if isinstance(m, Error))))


def split_chunk(piece: Piece) -> tuple[Piece, Piece] | None:
    """``piece``'s chunk in two at the step boundary nearest half its tokens; ``None`` when it
    cannot be split (one step, or logprobs not one per token)."""
    c = piece.msg
    calls = piece.calls
    if not isinstance(c, TokenChunk) or len(calls) < 2:
        return None
    if c.logprobs is not None and len(c.logprobs) != len(c.token_ids):
        return None
    if sum(n for n, _ in calls) != len(c.token_ids) or sum(n for _, n in calls) != len(c.text):
        return None
    half, tokens, cut = len(c.token_ids) / 2, 0, 1
    for i, (n, _) in enumerate(calls[:-1], 1):
        tokens += n
        cut = i
        if tokens >= half:
            break
    t = sum(n for n, _ in calls[:cut])
    ch = sum(n for _, n in calls[:cut])
    lp = c.logprobs
    first = replace(c, token_ids=c.token_ids[:t], text=c.text[:ch], logprobs=lp[:t] if lp is not None else None)
    second = replace(c, seq=c.seq + t, token_ids=c.token_ids[t:], text=c.text[ch:], text_offset=c.text_offset + ch,
                     logprobs=lp[t:] if lp is not None else None)
    return Piece(first, calls[:cut]), Piece(second, calls[cut:])


def reply_records(pieces: Sequence[Piece], max_bytes: int) -> list[bytes]:
    """The record values carrying ``pieces`` (chunks first, then finals), in order, each at most
    ``max_bytes`` unless a single message cannot be split (sent as it is: the bus refuses it and
    the requests in it take the failure path). One value, as before, when everything fits."""
    value = encode_replies([p.msg for p in pieces])
    if len(value) <= max_bytes:
        return [value]
    if len(pieces) > 1:
        mid = len(pieces) // 2
        return reply_records(pieces[:mid], max_bytes) + reply_records(pieces[mid:], max_bytes)
    halves = split_chunk(pieces[0])
    if halves is None:
        return [value]
    return reply_records(halves[:1], max_bytes) + reply_records(halves[1:], max_bytes)
