"""The edge's benchmark: `lockgate bench edge` (WebSocket fan-out with the fake worker) and its client, load and floor parts."""
