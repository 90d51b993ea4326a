"""`lockgate keys add`, `lockgate edge --help`, `lockgate bench edge --help`."""

from __future__ import annotations

import json

import pytest

from edge.config import hash_key, load_keys
from lockgate.cli import build_parser, main


def test_keys_add_appends_hashed(tmp_path, capsys):
    path = tmp_path / "keys.jsonl"
    assert main(["keys", "add", "--tenant", "acme", "--tier", "0", "--keys", str(path)]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("lg-") and key not in path.read_text()
    assert load_keys(path)[hash_key(key)].tier == 0


def test_keys_add_prints_entry_without_file(capsys):
    assert main(["keys", "add", "--tenant", "t"]) == 0
    key, line = capsys.readouterr().out.strip().splitlines()
    assert json.loads(line)["sha256"] == hash_key(key)


@pytest.mark.parametrize("argv", [["edge", "--help"], ["bench", "edge", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as ei:
        build_parser().parse_args(argv)
    assert ei.value.code == 0
    assert "--" in capsys.readouterr().out


@pytest.mark.parametrize("edges, client, workers", [(2, "raw", 1), (1, "websockets", 3)])
def test_bench_edge_every_token_arrives(tmp_path, edges, client, workers):
    """`lockgate bench edge`: every token of every stream arrives once, with either load generator;
    with `--edge-procs 2` two edges share one port (SO_REUSEPORT) and the kernel spreads the
    connections over both; with `--workers 3` three fake workers split the streams."""
    import subprocess
    import sys

    out = tmp_path / "edge.json"
    proc = subprocess.run(
        [sys.executable, "-m", "lockgate.cli", "--log-level", "WARNING", "bench", "edge", "--connections", "200",
         "--streams", "40", "--tokens", "20", "--step-ms", "5", "--client-procs", "1", "--edge-procs", str(edges),
         "--client", client, "--workers", str(workers), "--json", str(out)],
        capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["connections_held"] == 200 and r["connect_failures"] == 0
    assert len(r["connections_per_edge"]) == edges and min(r["connections_per_edge"]) > 0
    assert r["client"] == client and r["workers_per_edge"] == workers
    assert r["tokens_received"] == r["tokens_expected"] == 40 * 20
    assert r["connections_held_after_streaming"] == 200
    # the processes' CPU over the streaming phase, as a share of the machine: it was busy, and no
    # more than all of its CPUs (a little slack: the clients' windows are their own)
    assert 0 < r["cpu_busy_share"] <= 1.2 and 0 < r["edge_core_busy_share"] <= 1.2
    # the kernel floor, measured after the run, and the edge's CPU per token against it. No claim
    # that the edge costs more than a bare send: both are timings on a shared machine, and a noisy
    # CI host once measured a 75 us floor (0.98x) -- figures belong in the benchmark, not here.
    assert r["kernel_send_floor_us"] > 0 and r["edge_process_cpu_us_per_token"] > 0
    assert r["edge_cpu_over_floor"] == pytest.approx(
        r["edge_process_cpu_us_per_token"] / r["kernel_send_floor_us"], rel=0.02, abs=0.01)
    assert r["step_write_floor_ms"] == pytest.approx(40 / edges * r["kernel_send_floor_us"] / 1000, abs=0.01)


def test_bench_edge_rejects_more_workers_than_partitions(capsys):
    assert main(["bench", "edge", "--workers", "7", "--no-floor"]) == 2
    assert "--workers must be <= 6" in capsys.readouterr().err


def test_websockets_connection_lines_only_at_debug(capsys):
    """An edge's 10,000 clients must not print 20,000 INFO lines; --log-level DEBUG shows them."""
    import logging

    ws = logging.getLogger("websockets")
    before = ws.level
    try:
        ws.setLevel(logging.NOTSET)
        assert main(["--log-level", "DEBUG"]) == 2  # no subcommand: help, after logging is set up
        assert ws.level == logging.NOTSET
        assert main(["--log-level", "INFO"]) == 2
        assert ws.level == logging.WARNING
    finally:
        ws.setLevel(before)


def test_send_floor_measures_and_checks_its_arguments():
    from benchmarks.edge.floor import send_floor_us

    assert 0 < send_floor_us(20, rounds=3) < 10_000
    for bad in ({"n_sockets": 0}, {"n_sockets": 1, "rounds": 0}, {"n_sockets": 1, "payload": 1}):
        with pytest.raises(ValueError):
            send_floor_us(**{"n_sockets": 1, **bad})


def test_freeze_heap_moves_startup_objects_out_of_collections_and_slows_the_collector():
    """Servers call freeze_heap once started: start-up objects leave the collector's generations
    and young collections run every GC_GEN0_THRESHOLD allocations instead of 700."""
    import gc

    from lockgate.runtime import GC_GEN0_THRESHOLD, freeze_heap

    before = gc.get_threshold()
    try:
        freeze_heap()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[0] == GC_GEN0_THRESHOLD > before[0]
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_window_p99s_separate_a_stall_from_steady_windows():
    from benchmarks.edge.bench import window_p99s

    # three half-second windows of 1,000 latencies: 1 ms, then a stall (50 ms), then 2 ms
    published = [i * 0.0005 for i in range(3000)]
    latencies = [0.001] * 1000 + [0.05] * 1000 + [0.002] * 1000
    assert window_p99s(published, latencies) == pytest.approx([0.001, 0.05, 0.002])
    assert window_p99s(published[:1500], latencies[:1500]) == pytest.approx([0.001])  # short window left out
    assert window_p99s([], []) == []
    with pytest.raises(ValueError, match="publish stamps"):
        window_p99s([0.0], [])


@pytest.mark.parametrize("command", ["edge", "worker"])
def test_unreachable_broker_is_one_line_and_exit_1(tiny_model_dir, tmp_path, command, capsys):
    """A server that cannot reach its bus says so in one line naming the broker, no traceback. The
    worker connects before it loads its model (minutes on a GPU host): given a model that does not
    exist, the bus is still what it reports."""
    from lockgate.cli import main

    model = tiny_model_dir if command == "edge" else str(tmp_path / "no-such-model")
    rc = main([command, "--model", model, "--bus", "kafka://127.0.0.1:1?connect_timeout_s=0.5"]
              + (["--port", "0"] if command == "edge" else []))
    err = capsys.readouterr().err
    assert rc == 1
    assert f"lockgate {command}: error:" in err and "127.0.0.1:1 unreachable" in err and "Traceback" not in err


def test_edge_process_stops_on_sigterm_and_says_so(tiny_model_dir, run_until_signalled):
    rc, err = run_until_signalled(["edge", "--model", tiny_model_dir, "--port", "0", "--bus", "memory://edge-stop"],
                                  "lockgate edge on")
    assert rc == 0 and "lockgate edge: shutting down (0 connections to close)" in err
    assert "leaked" not in err and "Traceback" not in err, err[-2000:]
