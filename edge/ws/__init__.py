"""The WebSocket front end: the client frame protocol, one session per connection, the demo page.
Independent of the OpenAI front end (an import-linter contract)."""
