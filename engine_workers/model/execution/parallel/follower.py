"""A tensor-parallel rank other than 0: ``python -m engine_workers.model.execution.parallel.follower RANK WORLD
PORT TIMEOUT_S``, started by :class:`engine_workers.model.execution.parallel.group.TpGroup`.

It owns nothing but its shard of the weights and its own KV cache (its heads only). It loops on
rank 0's control frames (stdin): ``("load", kwargs)`` loads its shard, ``("runner", kwargs)`` builds
its cache and answers ``ready``, ``("step", n)`` receives the step's ``n`` int64s by broadcast and
runs the forward (its collectives pair with rank 0's), ``("quit",)`` exits 0. EOF on stdin (rank 0
died) or any failure exits non-zero: a rank never outlives its group. One torch thread (the host's
cores are shared by every rank).
"""

from __future__ import annotations

import logging
import sys
from datetime import timedelta


def main(argv: list[str]) -> int:
    rank, world, port, timeout_s = int(argv[0]), int(argv[1]), int(argv[2]), float(argv[3])
    logging.basicConfig(level=logging.WARNING, format=f"tp-rank{rank} %(levelname)s %(name)s: %(message)s")
    import torch
    import torch.distributed as dist

    from engine_workers.model.execution.parallel import step as step_codec
    from engine_workers.model.execution.parallel.group import gloo_env, read_frame
    from engine_workers.model.execution.runner import ModelRunner
    from engine_workers.model.loading.loader import load_model

    torch.set_num_threads(1)
    gloo_env()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    loaded = runner = None
    while True:
        frame = read_frame(stdin)
        if frame is None:
            return 3  # rank 0 is gone
        op = frame[0]  # type: ignore[index]
        if op == "quit":
            return 0
        if op == "load":
            loaded = runner = None
            try:
                loaded = load_model(**frame[1], tp_rank=(rank, world))  # type: ignore[index]
            except Exception:
                # rank 0 loads the same checkpoint and meets the same refusal (it reports it); a
                # failure of this rank alone is seen by rank 0 when it asks for the runner
                logging.getLogger(__name__).exception("tp rank %d: loading failed", rank)
        elif op == "runner":
            if loaded is None:
                return 4  # rank 0 loaded what this rank could not: it sees the exit code
            runner = ModelRunner(loaded, **frame[1])  # type: ignore[index]
            stdout.write(b"ready\n")
            stdout.flush()
        elif op == "step":
            assert runner is not None, "runner before step"
            flat = torch.empty(frame[1], dtype=torch.long)  # type: ignore[index]
            dist.broadcast(flat, src=0)
            runner.execute(step_codec.model_input(*step_codec.decode(flat)))
        else:
            raise ValueError(f"unknown control frame {op!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
