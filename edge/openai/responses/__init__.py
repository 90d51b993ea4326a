"""The Responses API (/v1/responses): body -> chat request (schema), output items and events
(sink), stored responses (store), the routes (routes)."""
