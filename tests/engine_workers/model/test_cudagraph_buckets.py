"""CUDA-graph decode buckets (engine_workers/model/execution/cudagraph/buckets.py), pure: the bucket grids,
which steps replay a graph and which run eager, and the padding of a decode step to a graph's shape."""

from __future__ import annotations

import pytest

from engine_workers.model.execution.cudagraph.buckets import batch_buckets, bucket, pad, plan, width_buckets

BS = 16


def test_batch_buckets_vllm_style_up_to_max_num_seqs():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert batch_buckets(20) == (1, 2, 4, 8, 16, 20)  # the scheduler's limit is the last bucket
    assert batch_buckets(1) == (1,) and batch_buckets(3) == (1, 2, 3) and batch_buckets(8) == (1, 2, 4, 8)
    with pytest.raises(ValueError, match="max_num_seqs"):
        batch_buckets(0)


def test_width_buckets_powers_of_two_then_the_longest_table():
    assert width_buckets(512) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert width_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert width_buckets(1) == (1,)


def test_smallest_bucket_that_holds_the_batch():
    sizes = batch_buckets(64)
    assert [bucket(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 63, 64)] == [1, 2, 4, 8, 8, 16, 24, 64, 64]
    assert bucket(65, sizes) is None


def _decode(start: int, first_block: int) -> tuple[list[int], int, list[int], bool]:
    return [7], start, list(range(first_block, first_block + start // BS + 1)), True


def test_plan_replays_decode_steps_and_names_why_others_run_eager():
    batches, widths = batch_buckets(8), width_buckets(8)
    step = [_decode(0, 0), _decode(40, 1), _decode(17, 5)]  # contexts of 1, 3 and 2 blocks
    assert plan(step, BS, batches, widths).key == (4, 4)
    assert plan([_decode(15, 0)], BS, batches, widths).key == (1, 1)
    assert plan([_decode(16, 0)], BS, batches, widths).key == (1, 2)  # position 16 opens a second block
    eager = {
        "prefill or mixed step": [([1, 2, 3], 0, [0], True)],
        "prefill or mixed step ": [_decode(3, 0), ([4, 5], 9, [1], True)],
        "prefill or mixed step  ": [([4], 9, [1], False)],  # a chunk that does not sample: prefill's last piece
        "batch of 9": [_decode(i, i) for i in range(9)],
        "context of 9 blocks": [_decode(8 * BS, 0)],
        "empty": [],
    }
    for reason, chunks in eager.items():
        got = plan(chunks, BS, batches, widths)
        assert got.key is None and reason.strip() in got.reason, (reason, got)
    for kw in ("every_row", "wants_hidden", "pools"):
        assert plan(step, BS, batches, widths, **{kw: True}).key is None
    with pytest.raises(ValueError, match="needs 2 blocks"):
        plan([([7], 20, [3], True)], BS, batches, widths)


def test_pad_points_padded_rows_at_the_dummy_block_only():
    dummy = 99
    step = [_decode(0, 0), _decode(40, 1), _decode(17, 5)]
    p = pad(step, (4, 4), BS, dummy)
    assert (p.real, p.batch, p.width) == (3, 4, 4)
    assert p.ids == (7, 7, 7, 0)
    assert p.positions == (0, 40, 17, 0)
    # each real token's K/V goes where the eager path writes it; the padded row's into the dummy block
    assert p.slots == (0 * BS + 0, 3 * BS + 8, 6 * BS + 1, dummy * BS)
    assert p.ctx == (1, 41, 18, 1)
    rows = [p.tables[i * 4:(i + 1) * 4] for i in range(4)]
    assert rows == [(0, 0, 0, 0), (1, 2, 3, 0), (5, 6, 0, 0), (dummy,) * 4]
    # no real row's context reaches a padded column: they attend only their own blocks
    for r in range(p.real):
        assert -(-p.ctx[r] // BS) == len(step[r][2])
    # a full bucket has no padded row; a step that does not fit is refused
    assert pad(step[:2], (2, 4), BS, dummy).batch == 2
    with pytest.raises(ValueError, match="do not fit"):
        pad(step, (2, 4), BS, dummy)
    with pytest.raises(ValueError, match="width 2"):
        pad(step, (4, 2), BS, dummy)
