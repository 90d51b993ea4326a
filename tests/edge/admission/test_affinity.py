"""Prefix-affine partitioning at the edge (edge/admission/affinity.py): the key function and the spill bound."""

from __future__ import annotations

from collections import Counter, deque

import pytest

from bus import ChatMessage, InferenceRequest, SamplingParams
from edge.admission.affinity import Placement, PrefixAffinity, prefix_key

SYSTEM = tuple(range(1000, 1080))  # 80 tokens shared


def _ids(i: int) -> tuple[int, ...]:
    return SYSTEM + (i, i + 1, i + 2)


def test_same_tenant_and_prefix_same_key_and_partition_another_tenant_independent() -> None:
    a1, a2 = prefix_key("acme", _ids(1), None), prefix_key("acme", _ids(7), None)
    assert a1 is not None and a1 == a2  # differs only after the first 64 tokens
    assert prefix_key("globex", _ids(1), None) != a1
    aff = PrefixAffinity()
    assert {aff.place("t", a1, 6) for _ in range(20)} == {aff.place("t", a1, 6)}  # cold: never spills
    # independent across tenants: the same 200 prefixes land on the same partition for two
    # tenants about 1/N of the time, not always
    same = sum(aff.place("t", prefix_key("acme", (p,) * 70, None), 6) ==  # type: ignore[arg-type]
               aff.place("t", prefix_key("globex", (p,) * 70, None), 6) for p in range(200))  # type: ignore[arg-type]
    assert 10 < same < 70


def test_the_system_message_is_the_prefix_and_short_prompts_have_none() -> None:
    sys_a = (ChatMessage("system", "You are a pirate."), ChatMessage("user", "hi"))
    sys_b = (ChatMessage("system", "You are a pirate."), ChatMessage("user", "a much longer question"))
    assert prefix_key("acme", (1, 2, 3), sys_a) == prefix_key("acme", (4, 5, 6, 7), sys_b) is not None
    assert prefix_key("acme", (1, 2, 3), (ChatMessage("user", "hi"),)) is None  # no system part, short
    assert prefix_key("acme", tuple(range(64)), None) is None  # exactly prefix_tokens: nothing beyond
    assert prefix_key("acme", tuple(range(65)), None) is not None


@pytest.mark.parametrize("hot_share,partitions", [(0.5, 6), (0.9, 6), (0.3, 12), (0.1, 6)])
def test_a_hot_prefix_spills_and_no_partition_gets_more_than_its_share(hot_share: float, partitions: int) -> None:
    window = 512
    aff = PrefixAffinity(window=window)
    hot = prefix_key("acme", SYSTEM, None)
    assert hot is not None
    recent: deque[int] = deque(maxlen=window)  # partitions of the hot prefix's requests in the window
    placed: deque[bytes] = deque(maxlen=window)
    worst = 0
    cold = 0
    for i in range(6000):
        if (i * hot_share) % 1 < hot_share:  # a deterministic hot_share of the traffic
            p = aff.place("t", hot, partitions)
            recent.append(p)
            placed.append(hot)
        else:
            cold += 1
            aff.place("t", prefix_key("acme", (cold,) * 70, None), partitions)  # type: ignore[arg-type]
            placed.append(b"")
            recent.append(-1)
        if i >= window:
            worst = max(worst, max(Counter(p for p in recent if p >= 0).values(), default=0))
    bound = window / partitions + 1  # docs/design.md, "Prefix-affine partitioning"
    assert worst <= bound + 1, (worst, bound)
    fan = len({p for p in recent if p >= 0})
    n_hot = sum(1 for p in recent if p >= 0)
    assert abs(n_hot / window - hot_share) < 0.15
    expected = max(1, -(-n_hot * partitions // window))
    assert fan == min(partitions, expected)  # as few partitions (prefix caches) as the bound allows


class _Bus:
    def __init__(self, n: int | None) -> None:
        self.n, self.calls = n, 0

    async def partitions_for(self, topic: str) -> list[int]:
        self.calls += 1
        if self.n is None:
            raise ConnectionError("down")
        return list(range(self.n))


def _req(rid: str, prompt: tuple[int, ...]) -> InferenceRequest:
    return InferenceRequest(rid, "m", prompt, SamplingParams(), "r", tenant="acme")


async def test_placement_falls_back_to_the_request_id() -> None:
    p = Placement(_Bus(6), PrefixAffinity())
    key, part = await p.place("t", _req("r1", _ids(1)))
    assert key == prefix_key("acme", _ids(1), None) and part is not None and 0 <= part < 6
    assert await p.place("t", _req("r2", (1, 2))) == (b"r2", None)  # no shareable prefix
    assert (await p.place("t", _req("r3", _ids(3))))[1] == part and p.bus.calls == 1  # type: ignore[attr-defined]
    down = Placement(_Bus(None), PrefixAffinity())
    assert await down.place("t", _req("r4", _ids(1))) == (b"r4", None)
    assert await Placement(_Bus(6), None).place("t", _req("r5", _ids(1))) == (b"r5", None)


def test_the_lora_adapter_is_part_of_the_affinity_key() -> None:
    """No KV is shared across adapters (docs/lora.md): the same prefix for two adapters (or an
    adapter and the base model) has two keys; the same adapter, one."""
    from edge.admission.affinity import prefix_key

    ids = list(range(100))
    keys = {lo: prefix_key("t", ids, None, 64, lo) for lo in (None, "a", "b")}
    assert len(set(keys.values())) == 3
    assert prefix_key("t", ids, None, 64, "a") == keys["a"]
    assert prefix_key("t", ids, None, 64) == keys[None]
