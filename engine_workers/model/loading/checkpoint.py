"""Reading a checkpoint folder's weight files tensor by tensor, or only a tensor-parallel rank's slices.

:class:`CheckpointReader` is the loader's weight source: ``take(name, split)`` returns one tensor
of the checkpoint, read when asked. Without a layout (TP=1) it is the whole tensor, exactly what
safetensors' ``load_file`` would have returned. With a rank's layout and a
:class:`~engine_workers.model.loading.sharding.slices.Split`, it is only that rank's ranges, read with
safetensors' ``get_slice`` (the file is memory-mapped; only the asked-for bytes are copied), so a
rank never materialises a whole sharded tensor. ``pytorch_model*.bin`` files cannot be read in
part: they are loaded whole (torch.load) and sliced in memory.

Every failure is a :class:`ModelError` naming the file (or the missing tensor). ``on_read``, when
given, is told ``(name, bytes)`` for every piece taken from a file: what a rank read, for tests and
logs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol

import torch

from engine_workers.model.loading.sharding.layout import RankLayout
from engine_workers.model.loading.sharding.slices import spans
from engine_workers.model.models.spec import ModelSpec
from engine_workers.model.models.split import Split
from tokenization.model_store import ModelError

ReadHook = Callable[[str, int], None]


class WeightSource(Protocol):
    """What the loader's name mapping takes its tensors from."""

    def take(self, name: str, split: Split | None = None) -> torch.Tensor: ...

    def __contains__(self, name: object) -> bool: ...


class DictSource:
    """Tensors already in memory (whole): ``split`` is ignored."""

    def __init__(self, tensors: dict[str, torch.Tensor], path: Path | str) -> None:
        self.tensors, self.path = tensors, path

    def take(self, name: str, split: Split | None = None) -> torch.Tensor:  # noqa: ARG002 (whole: no layout)
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelError(f"weights of {self.path} lack {name}") from None

    def __contains__(self, name: object) -> bool:
        return name in self.tensors


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: the shards a ``model.safetensors.index.json`` names (every one
    must be there), else every ``*.safetensors``, else ``pytorch_model*.bin``."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelError(f"cannot read {index}: {type(exc).__name__}: {exc}") from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ModelError(f"{index} names {len(missing)} shard(s) not in {path}: {', '.join(missing)}")
        return [path / n for n in names]
    st = sorted(path.glob("*.safetensors"))
    if st:
        return st
    bins = sorted(path.glob("pytorch_model*.bin"))
    if bins:
        return bins
    raise ModelError(f"no weights in {path}: expected *.safetensors or pytorch_model*.bin")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CheckpointReader:
    """The weights of folder ``path`` (whole, or rank ``layout``'s slices of the full model ``spec``).
    A context manager: the safetensors files stay open (memory-mapped) until it exits."""

    def __init__(self, path: Path, spec: ModelSpec | None = None, layout: RankLayout | None = None,
                 on_read: ReadHook | None = None) -> None:
        if layout is not None and spec is None:
            raise ValueError("a rank layout needs the full model's spec")
        self.path, self.spec, self.layout, self.on_read = path, spec, layout, on_read
        self._stack = ExitStack()
        self._where: dict[str, Path] = {}  # tensor name -> its safetensors file
        self._open: dict[Path, Any] = {}  # safetensors handles (safe_open), opened once
        self._whole: dict[str, torch.Tensor] = {}  # the .bin files' tensors, loaded whole
        files = weight_files(path)
        for f in files:
            try:
                if f.suffix == ".safetensors":
                    from safetensors import safe_open

                    handle = self._stack.enter_context(safe_open(str(f), framework="pt"))
                    self._open[f] = handle
                    self._where.update(dict.fromkeys(handle.keys(), f))
                else:
                    tensors = torch.load(f, map_location="cpu", weights_only=True)
                    self._whole.update(tensors)
                    if on_read is not None:
                        for name, t in tensors.items():
                            on_read(name, _nbytes(t))
            except Exception as exc:  # corrupt/truncated files raise many different types
                self._stack.close()
                raise ModelError(f"cannot read weights file {f}: {type(exc).__name__}: {exc}") from None

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._open.clear()
        self._whole.clear()

    def __contains__(self, name: object) -> bool:
        return name in self._where or name in self._whole

    def _ranges(self, split: Split | None) -> tuple[tuple[int, int], ...] | None:
        if split is None or self.layout is None:
            return None
        assert self.spec is not None
        return spans(split, self.spec, self.layout)

    def take(self, name: str, split: Split | None = None) -> torch.Tensor:
        """Tensor ``name``: whole, or (with a layout and a split) the rank's ranges along
        ``split.dim``, concatenated in order."""
        ranges = self._ranges(split)
        if name in self._whole:
            w = self._whole[name]
            if ranges is None:
                return w
            assert split is not None
            return torch.cat([w.narrow(split.dim, a, b - a) for a, b in ranges], dim=split.dim).contiguous()
        f = self._where.get(name)
        if f is None:
            raise ModelError(f"weights of {self.path} lack {name}")
        try:
            if ranges is None:
                out = self._open[f].get_tensor(name)
            else:
                assert split is not None
                piece = self._open[f].get_slice(name)
                shape = piece.get_shape()
                if split.dim >= len(shape) or any(not 0 <= a <= b <= shape[split.dim] for a, b in ranges):
                    raise ModelError(f"weights of {self.path}: {name} has shape {tuple(shape)}, which rank "
                                     f"{self.layout.rank if self.layout else 0}'s split {split.kind} along dim "
                                     f"{split.dim} ({ranges}) does not fit")
                lead = (slice(None),) * split.dim
                parts = [piece[(*lead, slice(a, b))] for a, b in ranges]
                out = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=split.dim)).contiguous()
        except ModelError:
            raise
        except Exception as exc:  # a truncated file fails only when its bytes are read
            raise ModelError(f"cannot read weights file {f}: {type(exc).__name__}: {exc}") from None
        if self.on_read is not None:
            self.on_read(name, _nbytes(out))
        return out
