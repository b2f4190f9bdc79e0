"""``llmbus top``: every live service's load and speed, read over the bus (the registry, and each
service's ``llmbus.metrics.<instance_id>`` answer), as a table refreshed every ``--interval``.

Rates (tokens and requests a second, the mean engine step, the prefix-cache hit share,
preemptions) are the change between two samples ``--interval`` apart; gauges (queue, running,
waiting, KV in use) are the latest sample's. ``--once`` prints one table and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmbus.bus import subjects
from llmbus.bus.connection import connect, default_nats_url, redact
from llmbus.bus.metrics import ask_all
from llmbus.bus.streams import read_registry
from llmbus.protocol import InstanceInfo, MetricsReply

ROLE_ORDER = {"gateway": 0, "router": 1, "prefill": 2, "decode": 3, "kvpool": 4}
COLUMNS = ("ROLE", "INSTANCE", "MODEL", "QUEUE", "RUN", "WAIT", "KV%", "TOK/S", "REQ/S", "STEP_MS", "CACHED%", "PREEMPT")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("top", help="every live service's load and speed, read over the bus")
    p.add_argument("--nats-url", default=default_nats_url(), help="the NATS server(s) the services use")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between samples (default 2)")
    p.add_argument("--once", action="store_true", help="print one table (two samples --interval apart) and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.interval > 0:
        raise ValueError(f"--interval must be > 0, got {args.interval}")
    try:
        return asyncio.run(_main(args.nats_url, args.interval, args.once, print))
    except KeyboardInterrupt:
        return 0


async def _main(url: str, interval: float, once: bool, out: Callable[[str], None]) -> int:
    nc = await connect(url)
    try:
        kv = await nc.jetstream().key_value(subjects.REGISTRY_BUCKET)
        before = await sample(nc, kv)
        while True:
            await asyncio.sleep(interval)
            after = await sample(nc, kv)
            text = render(table(before, after))
            if once:
                out(text)
                return 0
            out("\x1b[H\x1b[2J" + time.strftime("%H:%M:%S") + f"  llmbus top ({redact(url)})\n" + text)
            sys.stdout.flush()
            before = after
    finally:
        await nc.close()


@dataclass
class Sample:
    at: float
    instances: list[InstanceInfo]
    # the instances that answered: id -> "name" or "name{k=v}" -> value (histograms: _sum/_count)
    values: dict[str, dict[str, float]]


async def sample(nc, kv) -> Sample:
    instances = await read_registry(kv)
    others = [i for i in instances if i.role != "gateway"]
    replies = await ask_all(nc, others)
    values = {info.instance_id: flatten(reply) for info, reply in zip(others, replies) if reply is not None}
    return Sample(time.monotonic(), instances, values)


def flatten(reply: MetricsReply) -> dict[str, float]:
    """A reply's samples by name, summed over label sets, and by ``name{label=value}`` for one label."""
    out: dict[str, float] = {}
    for f in reply.families:
        for s in f.samples:
            parts = [("", s.value)] if f.kind != "histogram" else [("_sum", s.sum), ("_count", float(s.count))]
            for suffix, v in parts:
                out[f.name + suffix] = out.get(f.name + suffix, 0.0) + v
                for label, value in zip(f.labels, s.labels):
                    key = f"{f.name}{suffix}{{{label}={value}}}"
                    out[key] = out.get(key, 0.0) + v
    return out


def table(before: Sample, after: Sample) -> list[tuple[str, ...]]:
    dt = max(after.at - before.at, 1e-9)
    rows = []
    for info in sorted(after.instances, key=lambda i: (ROLE_ORDER.get(i.role, 9), i.instance_id)):
        now, then = after.values.get(info.instance_id, {}), before.values.get(info.instance_id, {})

        def delta(name: str) -> float:
            return now.get(name, 0.0) - then.get(name, 0.0)

        def rate(name: str) -> str:
            return f"{delta(name) / dt:.1f}"

        cells = dict.fromkeys(COLUMNS, "")
        cells.update(ROLE=info.role, INSTANCE=info.instance_id, MODEL=",".join(info.models) or "-")
        if info.role != "gateway" and info.instance_id not in after.values:
            cells["MODEL"] = "(no answer)"
        elif info.role in ("prefill", "decode"):
            total = now.get("llmbus_engine_kv_blocks", 0.0)
            steps = delta("llmbus_engine_step_seconds_count")
            prompt = delta("llmbus_engine_prompt_tokens_total")
            cells.update(
                QUEUE=str(info.queue_depth), RUN=f"{now.get('llmbus_engine_requests_running', 0):.0f}",
                WAIT=f"{now.get('llmbus_engine_requests_waiting', 0):.0f}",
                **{"KV%": f"{100 * (1 - now.get('llmbus_engine_kv_blocks_free', 0.0) / total):.0f}" if total else "-",
                   "TOK/S": rate("llmbus_engine_generation_tokens_total"),
                   "REQ/S": rate("llmbus_engine_requests_finished_total"),
                   "STEP_MS": f"{1000 * delta('llmbus_engine_step_seconds_sum') / steps:.2f}" if steps else "-",
                   "CACHED%": f"{100 * delta('llmbus_engine_cached_prompt_tokens_total') / prompt:.0f}" if prompt else "-",
                   "PREEMPT": f"{delta('llmbus_engine_preemptions_total'):.0f}"})  # fmt: skip
        elif info.role == "router":
            cells["REQ/S"] = rate("llmbus_router_requests_total")
        elif info.role == "kvpool":
            blocks = now.get("llmbus_kvpool_blocks", 0.0)
            lookups = delta("llmbus_kvpool_tier_lookups_total")
            cells.update(QUEUE=f"{now.get('llmbus_kvpool_active_leases', 0):.0f}", **{
                "KV%": f"{100 * (1 - now.get('llmbus_kvpool_free_blocks', 0.0) / blocks):.0f}" if blocks else "-",
                "CACHED%": f"{100 * delta('llmbus_kvpool_tier_hits_total') / lookups:.0f}" if lookups else "-"})
        rows.append(tuple(cells[c] for c in COLUMNS))
    return rows


def render(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    if not rows:
        lines.append("(no live services in the registry)")
    return "\n".join(lines)
