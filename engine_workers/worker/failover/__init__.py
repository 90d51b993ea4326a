"""Failover without the group protocol: peers presumed dead from their heartbeats
(``detector``), their requests taken over by the survivors (``takeover``). docs/worker.md, "Failover"."""
