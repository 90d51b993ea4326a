"""The worker actor: aging intake from the priority topics, the offset ledger, reply sending,
heartbeats, health and metrics around one engine."""
