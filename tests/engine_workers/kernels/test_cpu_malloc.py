"""glibc allocator tuning for the CPU engine (engine_workers/kernels/cpu_malloc.py)."""

from __future__ import annotations

import platform

import pytest

from engine_workers.kernels import cpu_malloc


def test_off_switch(monkeypatch):
    monkeypatch.setenv("LOCKGATE_NO_MALLOC_TUNING", "1")
    assert cpu_malloc._apply() == "off (LOCKGATE_NO_MALLOC_TUNING)"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_glibc_accepts_every_setting_once_per_process(monkeypatch):
    monkeypatch.delenv("LOCKGATE_NO_MALLOC_TUNING", raising=False)
    assert cpu_malloc._apply() == "applied mmap_threshold, trim_threshold, top_pad"
    first = cpu_malloc.tune()
    assert cpu_malloc.tune() == first  # idempotent: the engine calls it on every construction
