"""The engine's benchmarks: `lockgate bench engine|decode|accuracy|moe` and their parts (workload, engine processes, HF baselines, roofline, report)."""
