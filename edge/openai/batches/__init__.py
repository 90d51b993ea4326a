"""The OpenAI Files and Batches API on the bus (docs/protocol.md, "Files and batches")."""
