"""Routing policy: which model, which lane, which instance. Pure: no nats, no asyncio, no I/O."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from llmbus.protocol.messages import InstanceInfo


class RouteError(ValueError):
    """The request cannot be routed; the message is meant for the client."""


@dataclass(frozen=True)
class Route:
    model: str
    lane: str  # "short" | "long"


@dataclass(frozen=True)
class RoutingPolicy:
    """``models``: the served model names (empty: whatever live prefill instances report).
    ``long_threshold``: prompts with MORE tokens than this go to the long lane.
    ``kv_routing``: send a prompt to the prefill worker whose cache holds most of it (``place``).
    ``overlap_weight``: what one block to prefill costs against one block of load, and
    ``max_imbalance``: how many requests more than the least busy worker one may hold and still be
    sent one for its cache (``place``)."""

    models: tuple[str, ...] = ()
    long_threshold: int = 1024
    kv_routing: bool = True
    overlap_weight: float = 1.0
    max_imbalance: int = 8

    def __post_init__(self) -> None:
        if self.long_threshold < 1:
            raise ValueError(f"long_threshold must be >= 1 token, got {self.long_threshold}")
        if not self.overlap_weight > 0:
            raise ValueError(f"overlap_weight must be > 0, got {self.overlap_weight}")
        if self.max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0 requests, got {self.max_imbalance}")
        if any(not m for m in self.models):
            raise ValueError("model names must be non-empty")

    def served(self, live_models: Iterable[str] = ()) -> tuple[str, ...]:
        return self.models if self.models else tuple(sorted(set(live_models)))

    def route(self, model: str, num_prompt_tokens: int, live_models: Iterable[str] = ()) -> Route:
        served = self.served(live_models)
        if model not in served:
            names = ", ".join(served) if served else "none yet"
            raise RouteError(f"unknown model {model!r}; served models: {names}")
        if num_prompt_tokens < 1:
            raise RouteError("the prompt must have at least one token")
        return Route(model, "long" if num_prompt_tokens > self.long_threshold else "short")


def live_models(instances: Iterable[InstanceInfo], role: str = "prefill") -> set[str]:
    return {m for inst in instances if inst.role == role for m in inst.models}


@dataclass(frozen=True)
class Placement:
    """Where a routed request goes: ``instance``'s direct subject, or its lane when "" (any replica
    may pull it there). ``cached_blocks``: blocks of its prompt the choice expects to reuse."""

    instance: str = ""
    cached_blocks: int = 0


@dataclass(frozen=True)
class Load:
    """What the router sent a worker that its registry figures may not show yet."""

    blocks: int = 0
    requests: int = 0


def place(candidates: Iterable[InstanceInfo], hits: Mapping[str, int], pool_blocks: int, prompt_blocks: int,
          sent: Mapping[str, Load] | None = None, overlap_weight: float = 1.0, max_imbalance: int = 8) -> Placement:
    """Send a prompt to one prefill worker or to its lane, by cost in KV blocks (the unit NVIDIA
    Dynamo's KV router weighs too): ``overlap_weight`` x the blocks the worker must prefill, plus
    its load: the blocks its requests hold (registry: ``total_blocks - free_blocks``) and those
    the router ``sent`` it since.

    ``hits``: worker -> blocks of the prompt's chain its own cache holds (from the start);
    ``pool_blocks``: blocks kvpool's tiers can give ANY worker; ``prompt_blocks``: the prompt's
    reusable blocks. The lane costs the prefill kvpool cannot spare plus the least load: a worker
    is chosen only when its cache saves more than the lane would, that saving outweighs its extra
    load, and it holds at most ``max_imbalance`` requests more than the least busy worker (a hot
    prefix shared by many requests adds few blocks but a sequence each; past that it spreads, and
    the next worker caches it too). Ties: more reuse, then instance id (deterministic)."""
    pool = list(candidates)
    if not pool:
        return Placement()
    sent = sent or {}
    none = Load()
    load = {c.instance_id: max(0, c.total_blocks - c.free_blocks) + sent.get(c.instance_id, none).blocks for c in pool}
    requests = {c.instance_id: c.queue_depth + sent.get(c.instance_id, none).requests for c in pool}
    lane_cost = overlap_weight * max(0, prompt_blocks - pool_blocks) + min(load.values())
    least_busy = min(requests.values())
    best: tuple[float, int, str] | None = None
    for c in pool:
        if requests[c.instance_id] - least_busy > max_imbalance:
            continue
        reuse = min(prompt_blocks, max(hits.get(c.instance_id, 0), pool_blocks))
        key = (overlap_weight * (prompt_blocks - reuse) + load[c.instance_id], -reuse, c.instance_id)
        best = key if best is None or key < best else best
    if best is None:
        return Placement()
    cost, neg_reuse, instance = best
    if hits.get(instance, 0) <= pool_blocks or cost >= lane_cost:
        return Placement()
    return Placement(instance, -neg_reuse)


class Backlog:
    """What the router sent each worker that its registry figures may not show yet: an entry counts
    until the worker's next heartbeat after it (``updated_at``, unix s), or ``max_age_s`` (clocks
    of two hosts disagree). Pure: the caller passes the time."""

    def __init__(self, max_age_s: float = 6.0) -> None:
        self.max_age_s = max_age_s
        self._sent: dict[str, list[tuple[float, int]]] = {}

    def add(self, instance: str, blocks: int, now: float) -> None:
        self._sent.setdefault(instance, []).append((now, blocks))

    def load(self, instances: Iterable[InstanceInfo], now: float) -> dict[str, Load]:
        """What still counts, per instance of ``instances``; forgets the rest."""
        out: dict[str, Load] = {}
        live = {c.instance_id: c.updated_at for c in instances}
        for instance in list(self._sent):
            kept = [(t, n) for t, n in self._sent[instance]
                    if instance in live and t >= live[instance] and now - t < self.max_age_s]  # fmt: skip
            if kept:
                self._sent[instance] = kept
                out[instance] = Load(sum(n for _, n in kept), len(kept))
            else:
                del self._sent[instance]
        return out
