"""Tool-call parsers: model output text -> OpenAI ``tool_calls``, one parser per model family."""

from edge.chat.tool_parsers.parsers import (
    HERMES_HEAD,
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolCall,
    ToolParser,
    call_schema,
    configured_parser,
    get_parser,
    parser_for_model,
    raw_arguments,
)

__all__ = [
    "HERMES_HEAD",
    "PARSERS",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "ToolCall",
    "ToolParser",
    "call_schema",
    "configured_parser",
    "get_parser",
    "parser_for_model",
    "raw_arguments",
]
