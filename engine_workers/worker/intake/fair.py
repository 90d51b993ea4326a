"""Fair share across the tenants of one tier: start-time fair queueing (SFQ) over tokens. Pure.

Each tier has a virtual clock ``V`` (the start tag of the request it admitted last) and each tenant
the finish tag ``F`` of its latest request. A request of cost ``c`` tokens (prompt + ``max_tokens``)
from tenant ``i`` with weight ``w`` gets, when queued, the start tag ``S = max(V, F_i)`` and moves
``F_i`` to ``S + c / w``; within a tier the intake admits by smallest start tag (ties by push order).
Tags never change once assigned, so the intake stays a heap on a time-invariant key.

The bound (docs/worker.md, "Fair share"): while a request ``r`` of tenant ``i`` waits, each other
tenant ``j`` of its tier gets at most ``w_j / w_i · (n + 1) · c_i + c_j`` tokens admitted ahead of it,
with ``n`` the requests of ``i`` queued ahead of ``r`` (of cost ``c_i`` each) and ``c_j`` the cost of
one request of ``j``: a tenant flooding a tier cannot push a light tenant back by more than its
weighted share, however deep its own backlog.

No asyncio, no clock: the intake calls :meth:`FairShare.tag` on push and :meth:`FairShare.admitted`
on pop. Not thread-safe (one owner: the worker's event loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_WEIGHT = 1.0


def request_cost(prompt_tokens: int, max_tokens: int) -> float:
    """The tokens a request is charged: its prompt plus its output budget (what it may hold the
    engine for; the real output length is known only when it finishes). At least 1."""
    return float(max(1, prompt_tokens + max_tokens))


@dataclass(slots=True)
class _TierClock:
    virtual: float = 0.0  # start tag of the request admitted last
    finish: dict[str, float] = field(default_factory=dict)  # tenant -> finish tag of its latest request
    queued: int = 0


class FairShare:
    """Start tags per tier and tenant. ``tag`` on push, ``admitted`` on pop, ``dropped`` when a
    queued request leaves without being admitted (cancel, expiry, revoke)."""

    def __init__(self, num_tiers: int) -> None:
        self._tiers = [_TierClock() for _ in range(num_tiers)]

    def tag(self, tier: int, tenant: str, cost: float, weight: float = DEFAULT_WEIGHT) -> float:
        """The start tag of a request queued now; charges ``cost / weight`` to ``tenant``."""
        if not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight!r}")
        if not cost > 0:
            raise ValueError(f"cost must be > 0, got {cost!r}")
        clock = self._tiers[tier]
        start = max(clock.virtual, clock.finish.get(tenant, clock.virtual))
        clock.finish[tenant] = start + cost / weight
        clock.queued += 1
        return start

    def admitted(self, tier: int, start: float) -> None:
        """A request of ``tier`` with start tag ``start`` was taken out of the intake."""
        clock = self._tiers[tier]
        if start > clock.virtual:
            clock.virtual = start
            # A tenant whose finish tag V has passed would start at V anyway (max(V, F) = V):
            # its state says nothing and goes now, not only when the tier empties (under a tier
            # that never empties, every tenant ever seen there was kept).
            for tenant in [t for t, f in clock.finish.items() if f <= start]:
                del clock.finish[tenant]
        self._left(clock)

    def dropped(self, tier: int) -> None:
        """A queued request of ``tier`` left without being admitted (its charge stays: a tenant
        cannot reset its position by cancelling)."""
        self._left(self._tiers[tier])

    def _left(self, clock: _TierClock) -> None:
        clock.queued = max(0, clock.queued - 1)
        if clock.queued == 0:
            # Idle tier: every tenant starts even from here on (SFQ moves V past every finish tag),
            # and the per-tenant state is dropped, so it stays bounded by the tenants queued.
            clock.virtual = max([clock.virtual, *clock.finish.values()])
            clock.finish.clear()

    def virtual_time(self, tier: int) -> float:
        return self._tiers[tier].virtual

    def tenants(self, tier: int) -> int:
        """Tenants with state in ``tier``: those whose finish tag lies ahead of the tier's virtual
        clock (a request queued, or admitted within the last turn of the others)."""
        return len(self._tiers[tier].finish)
