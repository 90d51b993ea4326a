"""The OpenAI-compatible API's command-line option, shared by ``lockgate edge`` and ``lockgate serve``."""

from __future__ import annotations

import argparse
from typing import TypedDict

from lockgate.options import env_default

DEFAULT_OPENAI_PORT = 8000  # vLLM's port, so OpenAI clients configured for a local vLLM work as they are


def add_openai_port(p: argparse.ArgumentParser) -> None:
    p.add_argument("--openai-port", type=int, default=env_default("openai-port", DEFAULT_OPENAI_PORT),
                   help="port of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                        "/v1/responses, /v1/models, /tokenize, /health, ...); 0 = off [LOCKGATE_OPENAI_PORT]")
    p.add_argument("--tool-call-parser", choices=("hermes", "llama3_json", "mistral"),
                   default=env_default("tool-call-parser", None),
                   help="tool-call format of /v1/chat/completions (default: the served model's; SmolLM2, Qwen: "
                        "hermes) [LOCKGATE_TOOL_CALL_PARSER]")
    p.add_argument("--reasoning-parser", choices=("deepseek_r1", "qwen3"),
                   default=env_default("reasoning-parser", None),
                   help="split a reasoning model's <think>...</think> into reasoning_content (chat) and "
                        "reasoning items (Responses); default: off [LOCKGATE_REASONING_PARSER]")
    p.add_argument("--embedding-pooling", choices=("last", "mean"), default=env_default("embedding-pooling", "last"),
                   help="/v1/embeddings' pooling of the final hidden states: the last prompt token's or the mean "
                        "of every prompt token's (mean pooling skips the prefix cache), L2-normalised; a request's "
                        "extension field 'pooling' overrides it; default: last [LOCKGATE_EMBEDDING_POOLING]")

    p.add_argument("--max-file-bytes", type=int, default=env_default("max-file-bytes", 200 * 1024 * 1024),
                   help="largest upload to /v1/files, in bytes (stored chunked on the bus, so Kafka's record limit "
                        "does not cap it); default: 209715200, OpenAI's batch input limit [LOCKGATE_MAX_FILE_BYTES]")
    p.add_argument("--batch-max-in-flight", type=int, default=env_default("batch-max-in-flight", 8),
                   help="lines of one batch (/v1/batches) running at once, at tier 2; they count against the key's "
                        "max_streams like its live calls; default: 8 [LOCKGATE_BATCH_MAX_IN_FLIGHT]")


class BatchOptions(TypedDict):
    max_file_bytes: int
    batch_max_in_flight: int


def batch_options(args: argparse.Namespace) -> BatchOptions:
    """The Files and Batches API's flags as ``EdgeConfig`` keyword arguments (it checks the ranges)."""
    return {"max_file_bytes": args.max_file_bytes, "batch_max_in_flight": args.batch_max_in_flight}


def openai_port(args: argparse.Namespace) -> int | None:
    """``--openai-port`` as ``EdgeConfig.openai_port`` wants it: ``None`` when off (the CLI's 0)."""
    return args.openai_port or None


def openai_base_url(host: str, port: int) -> str:
    """The base URL to give an OpenAI client (``base_url``)."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{shown}:{port}/v1"
