"""The model: Llama-family layers, paged attention, checkpoint loading and the runner that
executes one batch."""
