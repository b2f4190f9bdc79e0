"""Per-tenant rate limits: requests and tokens per minute and per day, and requests in flight.

A gateway started with ``--tenant-limits FILE`` admits a generation request only when its tenant
(the API key's, or "" on an open gateway) has room on every limit it has, else answers 429
``rate_limit_exceeded`` with ``Retry-After``. Nothing is charged unless everything admits it.

- Requests and tokens per minute and per day are token buckets: each holds up to its period's
  allowance and refills continuously, so a tenant may burst its whole minute at once and then goes
  at the limit's pace; a daily quota spent comes back over the next 24 hours.
- A request reserves its prompt tokens plus ``max_tokens`` for each choice (the most it can use)
  when it is admitted; a request with no ``max_tokens`` reserves 256 a choice (its limit, the rest
  of the context, would take a whole bucket and run one request at a time). When it ends, the unused part goes back: a 500-token answer reserved at 4096
  is charged 500. A request that ends without its usage (the client left) keeps the whole
  reservation.
- A reservation larger than the smallest token allowance is cut to it, so a request whose prompt
  fits still runs once the buckets are full (and its true usage is charged, leaving them in debt);
  a prompt alone larger than that can never run and is a 400.
- ``max_concurrent_requests`` bounds the tenant's requests in flight here, so one tenant cannot
  take every batch slot.
- Limits that do not depend on the request's size (in flight, requests a minute or day) are
  checked before its prompt is tokenized, so a flood of refused requests costs little.

The file is JSON: ``{"default": {<limits>}, "tenants": {"<tenant>": {<limits>}}}``, limits being
any of ``requests_per_minute``, ``tokens_per_minute``, ``requests_per_day``, ``tokens_per_day``,
``max_concurrent_requests`` (positive integers), and ``priority``; a tenant's own entry overrides
the default field by field, and a limit set nowhere is no limit.

``priority`` (an integer, smaller first; 0 when set nowhere) is where the tenant's requests run: a
request that asks for none gets it, one that asks for a smaller (more urgent) one is held to it,
and one may always ask for a larger one. Below 0 a request is urgent: the bus keeps it in its own
queues, which workers empty first (docs/architecture.md, "Priorities").

Behind several gateways (all given the same file) the limits hold across the fleet: each gateway
reports what its tenants spent (``LimitUsage`` on ``llmbus.limits``: requests and tokens charged,
requests in flight) every 0.1 s while it changes, and every other gateway charges that to its own
buckets and counts those requests in flight, so a tenant may overshoot by at most what it spends
in one report period at each gateway. A gateway's reports on requests in flight count for 3 s
(it sends them every second while there are any), so a gateway that dies stops counting.

The buckets survive restarts: each gateway saves the levels of the tenants it serves to the KV
bucket ``llmbus_limits`` every second while they change, and when it stops; one that starts loads them,
refilled for the time since they were saved, so a daily quota spent is not forgiven by a restart.
It loses at most the last second's use of a gateway that crashed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

from nats.js.kv import KeyValue

from llmbus.bus import subjects
from llmbus.bus.streams import ensure_limits_bucket, read_bucket
from llmbus.protocol import LimitUsage, ProtocolError, TenantBuckets, TenantUsage, decode, encode
from llmbus.protocol.messages import check_priority
from services.gateway.config import read_json_file
from services.gateway.errors import APIError

log = logging.getLogger("llmbus.gateway")

REMOTE_IN_FLIGHT_S = 3.0  # another gateway's in-flight count lasts this long unless repeated

FIELDS = ("requests_per_minute", "tokens_per_minute", "requests_per_day", "tokens_per_day", "max_concurrent_requests",
          "priority")  # fmt: skip
# each bucket limit: (field, what it counts, its period in seconds, its name in refusals and headers)
BUCKETS = (("requests_per_minute", "requests", 60.0, "requests"), ("tokens_per_minute", "tokens", 60.0, "tokens"),
           ("requests_per_day", "requests", 86400.0, "requests-day"), ("tokens_per_day", "tokens", 86400.0, "tokens-day"))


@dataclass(frozen=True)
class Limits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    requests_per_day: int | None = None
    tokens_per_day: int | None = None
    max_concurrent_requests: int | None = None
    priority: int | None = None  # not a limit: the tenant's requests' priority (``effective_priority``)

    @classmethod
    def parse(cls, raw: object, where: str) -> Limits:
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must be a JSON object of limits, got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown limit {unknown[0]!r} (known: {', '.join(FIELDS)})")
        for name, value in raw.items():
            if name == "priority":
                check_priority(f"{where}.priority", value)
            elif type(value) is not int or value < 1:
                raise ValueError(f"{where}.{name} must be a positive integer, got {value!r}")
        return cls(**raw)

    def over(self, base: Limits) -> Limits:
        """These limits, each one unset taken from ``base``."""
        return Limits(**{f.name: getattr(self, f.name) if getattr(self, f.name) is not None else getattr(base, f.name)
                         for f in fields(self)})  # fmt: skip


def effective_priority(asked: int | None, tenant: int | None) -> int:
    """The priority a request runs at: what it ``asked`` (None: nothing), no smaller than its
    ``tenant``'s (None: no tenant limits, any), which it gets when it asked for none."""
    if tenant is None:
        return asked or 0
    return tenant if asked is None else max(asked, tenant)


@dataclass(frozen=True)
class TenantLimits:
    default: Limits = Limits()
    tenants: dict[str, Limits] | None = None

    @classmethod
    def load(cls, path: str | Path) -> TenantLimits:
        """Read a limits file; ValueError with a one-line message when it is not usable."""
        return cls.parse(read_json_file(path, "the tenant limits file"), str(path))

    @classmethod
    def parse(cls, raw: object, where: str = "tenant limits") -> TenantLimits:
        if not isinstance(raw, dict) or set(raw) - {"default", "tenants"}:
            raise ValueError(f"{where} must be a JSON object with 'default' and/or 'tenants'")
        tenants = raw.get("tenants", {})
        if not isinstance(tenants, dict):
            raise ValueError(f"{where}: 'tenants' must be an object {{tenant: limits}}")
        return cls(Limits.parse(raw.get("default", {}), f"{where}: default"),
                   {t: Limits.parse(v, f"{where}: tenants.{t}") for t, v in tenants.items()})

    def priority_of(self, tenant: str) -> int:
        """The tenant's priority (0 when set nowhere)."""
        priority = self.of(tenant).priority
        return 0 if priority is None else priority

    def of(self, tenant: str) -> Limits:
        own = (self.tenants or {}).get(tenant)
        return own.over(self.default) if own is not None else self.default


class Bucket:
    """Up to ``allowance`` units, refilled at ``allowance / period_s`` a second; may go below zero
    (debt) when more is charged than was reserved."""

    def __init__(self, allowance: int, period_s: float, now: float) -> None:
        self.capacity = float(allowance)
        self.rate = allowance / period_s
        self.level = self.capacity
        self.at = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now

    def wait(self, amount: float) -> float:
        """Seconds until ``amount`` is there (0 when it is now); refill first."""
        return max(0.0, (amount - self.level) / self.rate)

    def reset(self) -> float:
        """Seconds until the bucket is full again."""
        return max(0.0, (self.capacity - self.level) / self.rate)


class RateLimited(APIError):
    def __init__(self, limit: str, message: str, retry_after: float, headers: dict[str, str]) -> None:
        super().__init__(429, message, type=limit, code="rate_limit_exceeded",
                         headers={**headers, "retry-after": str(max(1, math.ceil(retry_after))),
                                  "retry-after-ms": str(max(1, math.ceil(retry_after * 1000)))})  # fmt: skip
        self.retry_after = retry_after


class _TenantState:
    def __init__(self, limits: Limits, now: float) -> None:
        self.limits = limits
        # (name, what it counts, bucket) for each bucket limit the tenant has
        self.buckets = [(name, unit, Bucket(getattr(limits, f), period, now))
                        for f, unit, period, name in BUCKETS if getattr(limits, f)]  # fmt: skip
        self.in_flight = 0
        self.remote: dict[str, tuple[int, float]] = {}  # other gateway -> (its requests in flight, when told)
        self.spent = [0, 0]  # requests and tokens charged here since the last report
        self.reported_in_flight = 0

    def others_in_flight(self, now: float) -> int:
        for gateway in [g for g, (_, at) in self.remote.items() if now - at > REMOTE_IN_FLIGHT_S]:
            del self.remote[gateway]
        return sum(n for n, _ in self.remote.values())

    def token_buckets(self) -> list[Bucket]:
        return [b for _, unit, b in self.buckets if unit == "tokens"]


class RateLimiter:
    """Every tenant's buckets and requests in flight; ``admit`` then, once, ``Admission.settle``."""

    def __init__(self, config: TenantLimits, clock: Callable[[], float] = time.monotonic,
                 on_limited: Callable[[str, str], None] | None = None,
                 wall: Callable[[], float] = time.time) -> None:  # fmt: skip
        self.config = config
        self.clock = clock
        self.wall = wall  # unix seconds, for the levels saved across restarts
        self.on_limited = on_limited  # (tenant, limit) of each refusal, for /metrics
        self._tenants: dict[str, _TenantState] = {}
        self._unsaved: set[str] = set()  # tenants whose buckets changed since the last save

    def _state(self, tenant: str) -> _TenantState:
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _TenantState(self.config.of(tenant), self.clock())
        return state

    def precheck(self, tenant: str) -> None:
        """Refuse now what ``admit`` would refuse whatever the request's size (requests in flight,
        requests per minute or day), so a refused request costs no tokenizing. Charges nothing."""
        self._check(tenant, None)

    def admit(self, tenant: str, prompt_tokens: int, max_new_tokens: int, param: str = "messages") -> Admission:
        """Charge one request of ``prompt_tokens`` that may generate ``max_new_tokens`` (all choices);
        RateLimited (429) when a limit has no room yet, APIError 400 (naming ``param``, the field
        that holds the prompt) when its prompt can never fit."""
        state, reserved = self._check(tenant, (prompt_tokens, max_new_tokens), param)
        for _, unit, bucket in state.buckets:
            bucket.level -= 1 if unit == "requests" else reserved
        state.in_flight += 1
        reserved = reserved if state.token_buckets() else 0
        state.spent[0] += 1
        state.spent[1] += reserved
        self._unsaved.add(tenant)
        return Admission(self, state, reserved, self.headers(state), tenant)

    def unsaved(self) -> list[TenantBuckets]:
        """Each bucket, refilled to now, of the tenants whose use here changed since the last call,
        one record a bucket (gateways whose limits differ then keep each other's buckets). What other
        gateways report is charged here but saved by them: a tenant's levels are written by the
        gateways serving it."""
        now, at = self.clock(), self.wall()
        out = []
        for tenant in sorted(self._unsaved):
            for name, _, bucket in self._tenants[tenant].buckets:
                bucket.refill(now)
                out.append(TenantBuckets(tenant, {name: bucket.level}, at))
        self._unsaved.clear()
        return out

    def restore(self, saved: TenantBuckets) -> None:
        """Take up a tenant's saved levels, refilled for the time since they were saved (a bucket
        its limits here no longer have is ignored; one they newly have starts full)."""
        state = self._state(saved.tenant)
        now, elapsed = self.clock(), max(0.0, self.wall() - saved.saved_at)
        for name, _, bucket in state.buckets:
            if name in saved.levels:
                bucket.refill(now)
                bucket.level = min(bucket.capacity, saved.levels[name] + elapsed * bucket.rate)

    def usage(self, every: bool = False) -> list[TenantUsage]:
        """What this gateway's tenants spent since the last call, and their requests in flight: the
        tenants whose figures changed (``every``: also those with requests in flight)."""
        out = []
        for tenant, state in self._tenants.items():
            changed = state.spent != [0, 0] or state.in_flight != state.reported_in_flight
            if changed or (every and state.in_flight):
                out.append(TenantUsage(tenant, state.spent[0], state.spent[1], state.in_flight))
                state.spent = [0, 0]
                state.reported_in_flight = state.in_flight
        return out

    def charge(self, gateway: str, usage: list[TenantUsage]) -> None:
        """Charge what another gateway's tenants spent there to the buckets here, and count their
        requests in flight there (a refund, negative tokens, refills no further than full)."""
        now = self.clock()
        for u in usage:
            state = self._state(u.tenant)
            for _, unit, bucket in state.buckets:
                bucket.refill(now)
                bucket.level = min(bucket.capacity, bucket.level - (u.requests if unit == "requests" else u.tokens))
            state.remote[gateway] = (u.in_flight, now)

    def _check(self, tenant: str, size: tuple[int, int] | None, param: str = "messages") -> tuple[_TenantState, int]:
        """Refill every bucket, then refuse when any limit lacks room (Retry-After: the longest
        wait); the request's token reservation otherwise. ``size`` None: token buckets unchecked."""
        state = self._state(tenant)
        now = self.clock()
        lim = state.limits
        for _, _, bucket in state.buckets:
            bucket.refill(now)
        reserved = 0
        if size is not None:
            prompt_tokens, max_new_tokens = size
            reserved = prompt_tokens + max_new_tokens
            if tokens := state.token_buckets():
                least = int(min(b.capacity for b in tokens))
                if prompt_tokens > least:
                    raise APIError(400, f"The prompt has {prompt_tokens} tokens, more than this tenant's token limit "
                                   f"({least} a {'minute' if least == lim.tokens_per_minute else 'day'}): it can never "
                                   "run.", param=param, code="request_too_large")  # fmt: skip
                reserved = min(reserved, least)
        if lim.max_concurrent_requests is not None and state.in_flight + state.others_in_flight(now) >= lim.max_concurrent_requests:
            self._refuse(tenant, state, "concurrent", 1.0,
                         f"Too many requests in flight for this tenant: limit {lim.max_concurrent_requests}. "
                         "Retry once one of them ends.")  # fmt: skip
        short = [(bucket.wait(1 if unit == "requests" else reserved), name, unit, bucket)
                 for name, unit, bucket in state.buckets if size is not None or unit == "requests"]
        wait, name, unit, bucket = max(short, key=lambda w: w[0], default=(0.0, "", "", None))
        if wait > 0:  # NOTE: the longest wait: a client retrying after it finds every limit with room
            per = "day" if name.endswith("-day") else "minute"
            what = "1 request" if unit == "requests" else f"{reserved} tokens (prompt plus max_tokens)"
            self._refuse(tenant, state, name, wait,
                         f"Rate limit reached for {unit} per {per}: limit {int(bucket.capacity)}, this request "
                         f"needs {what}. Please try again in {wait:.1f}s.")  # fmt: skip
        return state, reserved

    def _refuse(self, tenant: str, state: _TenantState, limit: str, wait: float, message: str):
        if self.on_limited is not None:
            self.on_limited(tenant, limit)
        raise RateLimited(limit, message, wait, self.headers(state))

    @staticmethod
    def headers(state: _TenantState) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for what the tenant has now (``-day`` ones for the
        daily limits)."""
        out = {}
        for name, _, bucket in state.buckets:
            out[f"x-ratelimit-limit-{name}"] = str(int(bucket.capacity))
            out[f"x-ratelimit-remaining-{name}"] = str(max(0, math.floor(bucket.level)))
            out[f"x-ratelimit-reset-{name}"] = f"{bucket.reset():.3f}s"
        return out


class Admission:
    """One admitted request's charge; ``settle`` once it ends (further calls do nothing)."""

    def __init__(self, limiter: RateLimiter, state: _TenantState, reserved: int, headers: dict[str, str],
                 tenant: str = "") -> None:  # fmt: skip
        self._limiter, self._state, self.reserved, self.tenant = limiter, state, reserved, tenant
        self.headers = headers  # x-ratelimit-* as of the admission, for the answer
        self.settled = False

    def settle(self, used_tokens: int | None = None) -> None:
        """Free the request's place in flight and charge ``used_tokens`` instead of the reservation
        (None: keep the reservation, usage unknown)."""
        if self.settled:
            return
        self.settled = True
        state = self._state
        state.in_flight -= 1
        if used_tokens is not None:
            now = self._limiter.clock()
            for bucket in state.token_buckets():
                bucket.refill(now)
                bucket.level = min(bucket.capacity, bucket.level + self.reserved - used_tokens)
            if state.token_buckets():
                state.spent[1] += used_tokens - self.reserved
                self._limiter._unsaved.add(self.tenant)


async def share_usage(limiter: RateLimiter, nc, gateway: str, period_s: float = 0.1, every_s: float = 1.0) -> None:
    """Until cancelled: report this gateway's tenants' use on ``llmbus.limits`` (see the module's
    docstring) and charge what the other gateways report."""

    async def on_usage(msg) -> None:
        try:
            report = decode(LimitUsage, msg.data)
        except ProtocolError as exc:
            log.debug("dropping a malformed limit usage report: %s", exc)
            return
        if report.gateway != gateway:
            limiter.charge(report.gateway, report.tenants)

    async def report(every: bool) -> None:
        if usage := limiter.usage(every):
            with contextlib.suppress(Exception):  # NATS reconnecting: this period's use goes unreported
                await nc.publish(subjects.LIMITS, encode(LimitUsage(gateway, usage)))

    sub = await nc.subscribe(subjects.LIMITS, cb=on_usage)
    last_every = time.monotonic()
    try:
        while True:
            await asyncio.sleep(period_s)
            every = time.monotonic() - last_every >= every_s
            if every:
                last_every = time.monotonic()
            await report(every)
    finally:
        await report(False)  # the last answers' refunds, and no requests in flight any more
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def load_buckets(limiter: RateLimiter, js) -> KeyValue:
    """The ``llmbus_limits`` bucket, after taking up every tenant's saved levels from it."""
    kv = await ensure_limits_bucket(js)
    for saved in await read_bucket(kv, subjects.LIMITS_BUCKET, TenantBuckets):
        limiter.restore(saved)
    return kv


async def save_buckets(limiter: RateLimiter, kv: KeyValue) -> None:
    """Save the levels of the tenants whose buckets changed (best effort: NATS reconnecting loses
    this round's, and the next change saves them again)."""
    for saved in limiter.unsaved():
        (name,) = saved.levels
        with contextlib.suppress(Exception):
            await kv.put(subjects.limits_key(saved.tenant, name), encode(saved))


async def keep_buckets(limiter: RateLimiter, kv: KeyValue, period_s: float = 1.0) -> None:
    """Until cancelled, ``save_buckets`` every ``period_s``; once more when cancelled."""
    try:
        while True:
            await asyncio.sleep(period_s)
            await save_buckets(limiter, kv)
    finally:
        await save_buckets(limiter, kv)
