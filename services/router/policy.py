"""Routing policy: which model, which lane, which instance. Pure: no nats, no asyncio, no I/O."""

from __future__ import annotations

from collections.abc import Iterable
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
    ``long_threshold``: prompts with MORE tokens than this go to the long lane."""

    models: tuple[str, ...] = ()
    long_threshold: int = 1024

    def __post_init__(self) -> None:
        if self.long_threshold < 1:
            raise ValueError(f"long_threshold must be >= 1 token, got {self.long_threshold}")
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


def pick_instance(candidates: Iterable[InstanceInfo], model: str, role: str) -> InstanceInfo | None:
    """The least-loaded live instance of ``role`` serving ``model``: fewest queued requests, then
    most free blocks, then instance id (deterministic). None when there is none."""
    pool = [c for c in candidates if c.role == role and model in c.models]
    if not pool:
        return None
    return min(pool, key=lambda c: (c.queue_depth, -c.free_blocks, c.instance_id))


def live_models(instances: Iterable[InstanceInfo], role: str = "prefill") -> set[str]:
    return {m for inst in instances if inst.role == role for m in inst.models}
