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
    ``kv_routing``: send a prompt to the prefill worker whose cache holds most of it, unless that
    worker holds more than ``max_imbalance`` requests above the least busy one (``place``).
    ``whole_threshold``: prompts of at most this many tokens skip the prefill pool when the model
    has decode workers, which prefill and decode them whole (0: never). 128 by default: on 2 CPU
    cores that serves short prompts 1.2x faster, at no cost to the decode pool's TPOT
    (docs/benchmarks.md)."""

    models: tuple[str, ...] = ()
    long_threshold: int = 1024
    kv_routing: bool = True
    max_imbalance: int = 2
    whole_threshold: int = 128

    def __post_init__(self) -> None:
        if self.long_threshold < 1:
            raise ValueError(f"long_threshold must be >= 1 token, got {self.long_threshold}")
        if self.whole_threshold < 0:
            raise ValueError(f"whole_threshold must be >= 0 tokens, got {self.whole_threshold}")
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


def whole(policy: RoutingPolicy, model: str, num_prompt_tokens: int, instances: Iterable[InstanceInfo]) -> bool:
    """Whether a prompt goes to the decode pool whole (conditional disaggregation): short enough,
    and a live decode worker serves the model (colocated deployments have none)."""
    return 0 < num_prompt_tokens <= policy.whole_threshold and any(
        i.role == "decode" and model in i.models for i in instances)


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
    """A worker as the router sees it: the requests it holds, and how many more it would pull now
    (None: it does not say)."""

    requests: int = 0
    room: int | None = None


def place(loads: Mapping[str, Load], hits: Mapping[str, int], pool_blocks: int, max_imbalance: int = 2) -> Placement:
    """Send a prompt to one prefill worker, or to its lane.

    ``loads``: worker -> Load; ``hits``: worker -> blocks of the prompt's chain its own cache holds
    (from the start); ``pool_blocks``: blocks kvpool's tiers can give ANY worker. A worker with no
    room (it would not pull the request now: it would wait in that worker's queue alone) or
    holding more than ``max_imbalance`` requests above the least busy one is passed over (a hot
    prefix shared by many requests spreads, and the next worker caches it too). Among the rest, the
    one whose cache reuses most of the prompt (ties: fewer requests, then instance id), but only
    when that beats kvpool's tiers: else the lane takes it, where any replica pulls it as it has
    room."""
    if not loads:
        return Placement()
    least = min(load.requests for load in loads.values())
    eligible = [w for w, load in loads.items()
                if load.requests - least <= max_imbalance and (load.room is None or load.room > 0)]  # fmt: skip
    if not eligible:
        return Placement()
    best = min(eligible, key=lambda w: (-hits.get(w, 0), loads[w].requests, w))
    if hits.get(best, 0) <= pool_blocks:
        return Placement()
    return Placement(best, hits[best])


class Backlog:
    """Requests the router sent each worker by name, for the worker's load until its own figures
    show them: a load report that lists them as taken, a report (or heartbeat) from well after
    they were sent, or ``max_age_s`` (one lost on the way). ``since(worker, t, now)`` counts those
    sent at ``t`` or later and not reported taken. Pure: the caller passes the times."""

    def __init__(self, max_age_s: float = 2.0) -> None:
        self.max_age_s = max_age_s
        self._sent: dict[str, dict[str, float]] = {}  # worker -> request id -> when sent

    def add(self, worker: str, request_id: str, now: float) -> None:
        self._sent.setdefault(worker, {})[request_id] = now

    def taken(self, worker: str, request_ids: Iterable[str]) -> None:
        """``worker`` reported these: its own request count holds them now."""
        sent = self._sent.get(worker, {})
        for rid in request_ids:
            sent.pop(rid, None)

    def since(self, worker: str, t: float, now: float) -> int:
        kept = {rid: at for rid, at in self._sent.get(worker, {}).items() if at >= t and now - at < self.max_age_s}
        if kept:
            self._sent[worker] = kept
        else:
            self._sent.pop(worker, None)
        return len(kept)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop every worker but ``keep``."""
        keep = set(keep)
        for worker in [w for w in self._sent if w not in keep]:
            del self._sent[worker]
