"""The engine: configuration, sequences, the scheduler (decides), the engine step, sampling,
detokenization, and the async shell that runs steps on the torch thread."""
