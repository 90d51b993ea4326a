"""One module of CLI subcommands per product area; each has ``register(sub, bench)``."""
