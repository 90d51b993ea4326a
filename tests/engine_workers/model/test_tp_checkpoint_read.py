"""Each tensor-parallel rank reads only its slices of the checkpoint (engine_workers/model/loading/checkpoint.py).

Per rank, the state read slice by slice equals bit for bit the layout's reference
(``shard_state`` over the whole mapped checkpoint) for the tiny random checkpoint of every family
test_tensor_parallel.py runs, a sharded checkpoint with an index file, a ``.bin`` one and the
default model. What the reader is asked for, counted per tensor by its ``on_read`` hook, shows no
rank materialises a sharded tensor whole: over the ranks each sharded tensor is read exactly once
(the pieces partition it), and only norms, routers and row-split biases are read whole by every rank.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from engine_workers.model.loading.loader import checkpoint_state
from engine_workers.model.loading.sharding.layout import rank_layout
from engine_workers.model.models.spec import ModelSpec
from tests.engine_workers.model import test_checkpoints as checkpoints
from tests.engine_workers.model import test_tensor_parallel as tp
from tests.engine_workers.model.tp_reference import shard_state

# the only checkpoint tensors a rank may read whole: replicated (norms, routers) or tiny (biases
# of row-split layers, added on rank 0 after the all-reduce)
WHOLE = ("norm.weight", "gate.weight", "router.weight", "router.bias", "o_proj.bias", "down_proj.bias",
         "down_proj_bias")


def _spec(path) -> ModelSpec:
    from transformers import AutoConfig

    return ModelSpec.from_hf(AutoConfig.from_pretrained(path))


def _read(path, spec, layout=None) -> tuple[dict[str, torch.Tensor], Counter]:
    reads: Counter = Counter()

    def hook(name: str, nbytes: int) -> None:
        reads[name] += nbytes

    return checkpoint_state(Path(path), spec, layout, on_read=hook), reads


def _check(path, world: int = 2) -> tuple[Counter, list[Counter]]:
    """Every rank's read state equals the reference; returns the bytes read per tensor, whole and per rank."""
    spec = _spec(path)
    full, whole = _read(path, spec)
    per_rank = []
    for rank in range(world):
        lay = rank_layout(spec, rank, world)
        want = shard_state(full, spec, lay)
        got, reads = _read(path, spec, lay)
        assert got.keys() == want.keys()
        for name, w in want.items():
            g = got[name]
            assert (g.dtype, g.shape) == (w.dtype, w.shape), (name, rank)
            assert torch.equal(g, w), (name, rank)
        per_rank.append(reads)
    return whole, per_rank


def _assert_partitioned(whole: Counter, per_rank: list[Counter]) -> None:
    """Each tensor is either split (the ranks' pieces add up to it once, none of them whole) or one
    of the few replicated ones every rank reads whole."""
    assert all(r.keys() == whole.keys() for r in per_rank)
    for name, size in whole.items():
        got = [r[name] for r in per_rank]
        if name.endswith(WHOLE):
            assert got == [size] * len(per_rank), name
        else:
            assert sum(got) == size and max(got) < size, (name, got, size)


@pytest.mark.parametrize("name", list(tp.FAMILIES))
def test_family_rank_reads_equal_the_sharded_state(name, tmp_path):
    whole, per_rank = _check(tp.save(name, tmp_path / name))
    _assert_partitioned(whole, per_rank)


def test_sharded_index_checkpoint(tmp_path):
    path = checkpoints.save(tmp_path / "m", tie=False, dtype=torch.bfloat16)
    assert (path / "model.safetensors.index.json").is_file()
    whole, per_rank = _check(path)
    _assert_partitioned(whole, per_rank)


def test_bin_checkpoint_still_loads_but_whole(tmp_path):
    from safetensors.torch import load_file

    src = tp.save("qwen2", tmp_path / "st")
    out = tmp_path / "bin"
    out.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    torch.save(load_file(str(src / "model.safetensors")), out / "pytorch_model.bin")
    assert not list(out.glob("*.safetensors")) and list(out.glob("pytorch_model*.bin"))
    whole, per_rank = _check(out)
    # a .bin file cannot be read in part: each rank loads it whole (docs/design-history.md, Loading)
    assert all(r == whole for r in per_rank)


@pytest.mark.slow
def test_default_model_rank_reads_about_its_share(default_model_dir):
    whole, per_rank = _check(default_model_dir)
    _assert_partitioned(whole, per_rank)
    total = sum(whole.values())
    replicated = sum(v for k, v in whole.items() if k.endswith(WHOLE))
    assert replicated < 0.01 * total
    # SmolLM2 at TP=2: MLP and vocabulary halve, attention splits 2/3 + 1/3 (whole GQA groups)
    for reads in per_rank:
        assert sum(reads.values()) < 0.6 * total
