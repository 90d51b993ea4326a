"""The OpenAI-compatible HTTP front end: routes, request schemas, streaming, tool calls (with the
tool-call parsers in :mod:`edge.chat.tool_parsers`). Independent of the WebSocket front end."""
