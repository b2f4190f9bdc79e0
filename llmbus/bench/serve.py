"""`llmbus bench serve`: the asyncio load generator against an OpenAI-compatible endpoint."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from llmbus.bench.arrivals import ArrivalProcess
from llmbus.bench.client import RequestConfig, send
from llmbus.bench.cputime import tree_cpu_s
from llmbus.bench.datasets import BenchItem, sessions
from llmbus.bench.metrics import summarize
from llmbus.bench.progress import Progress
from llmbus.bench.record import RequestRecord
from llmbus.bench.slo import SLO


@dataclass(frozen=True)
class LoadConfig:
    arrivals: ArrivalProcess = ArrivalProcess()
    max_concurrency: int | None = None
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be >= 1, got {self.max_concurrency}")


async def _run_sessions(client: httpx.AsyncClient, req: RequestConfig, load: LoadConfig,
                        items: list[BenchItem], progress: Progress | None) -> tuple[list[RequestRecord], float]:
    records: list[RequestRecord] = []
    position = {id(it): i for i, it in enumerate(items)}
    units = sessions(items)
    sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    schedule = load.arrivals.schedule(len(units), load.seed)
    t0 = time.perf_counter()

    async def one(unit: list[BenchItem], arrival: float) -> None:
        # NOTE: a conversation holds its concurrency slot across its turns, like one user would.
        if sem is not None:
            await sem.acquire()
        try:
            for item in unit:
                rec = RequestRecord(index=position[id(item)], kind=item.kind, conversation=item.conversation,
                                    turn=item.turn, arrival_s=arrival)
                records.append(rec)
                rec.start_s = time.perf_counter() - t0
                await send(client, req, item, rec)
                if progress:
                    progress.update(rec.success)
        finally:
            if sem is not None:
                sem.release()

    tasks = []
    for unit, arrival in zip(units, schedule):
        delay = t0 + arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(unit, arrival)))
    await asyncio.gather(*tasks)
    end = max((r.start_s + r.e2e_s for r in records if r.e2e_s is not None), default=time.perf_counter() - t0)
    return records, max(end, 1e-9)


def _limits(load: LoadConfig, n: int) -> httpx.Limits:
    cap = load.max_concurrency or n
    return httpx.Limits(max_connections=max(cap, 1), max_keepalive_connections=max(cap, 1))


async def run_serve(req: RequestConfig, load: LoadConfig, items: list[BenchItem], *,
                    warmup: list[BenchItem] = (), slo: SLO | None = None,
                    server_pids: list[int] | None = None) -> tuple[list[RequestRecord], dict]:
    """Warm up (unmeasured, all at once within the concurrency cap), then run `items` under the
    arrival process. Returns the measured records and the summary."""
    if not items:
        raise ValueError("the dataset is empty: nothing to benchmark")
    async with httpx.AsyncClient(limits=_limits(load, len(items)), timeout=req.timeout_s) as client:
        if warmup:
            warm_load = LoadConfig(max_concurrency=load.max_concurrency, seed=load.seed, progress=False)
            await _run_sessions(client, req, warm_load, list(warmup), None)
        progress = Progress(len(items), "bench serve") if load.progress else None
        cpu0 = tree_cpu_s(server_pids) if server_pids else None
        client_cpu0 = time.process_time()
        records, duration = await _run_sessions(client, req, load, list(items), progress)
        client_cpu = time.process_time() - client_cpu0
        cpu = tree_cpu_s(server_pids) - cpu0 if server_pids else None
    records.sort(key=lambda r: (r.start_s, r.index))
    summary = summarize(records, duration, slo, cpu_s=cpu)
    summary["client_cpu_s"] = client_cpu  # NOTE: the load generator's own cost, to judge its interference
    return records, summary
