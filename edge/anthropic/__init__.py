"""The Anthropic Messages API front end (``/v1/messages``, ``/v1/messages/count_tokens``), served on
the OpenAI API's port. Independent of the OpenAI and WebSocket front ends; what it shares with
them is in :mod:`edge.chat` and :mod:`edge.admission`."""
