"""`llmbus bench offline`: the in-process engine (or Hugging Face static batches) on a dataset.

Both backends write the serve report's shape. Requests arrive on the same arrival process as in
`bench serve` (default: all at once); times are measured in-process, so there is no network.
CPU seconds are this process's (all threads), from time.process_time.
"""

from __future__ import annotations

import time
from collections import deque

from llmbus.bench.arrivals import ArrivalProcess
from llmbus.bench.datasets import BenchItem
from llmbus.bench.progress import Progress
from llmbus.bench.record import RequestRecord

BACKENDS = ("llmbus", "hf")


class TokenClock:
    """Per-request token timing shared by both backends."""

    def __init__(self, items: list[BenchItem], arrivals: list[float]) -> None:
        self.t0 = time.perf_counter()
        self.records = [RequestRecord(index=i, kind=it.kind, conversation=it.conversation, turn=it.turn,
                                      arrival_s=a, prompt_len=it.prompt_len, requested_output_len=it.output_len,
                                      prompt_tokens=it.prompt_len, usage_reported=True)
                        for i, (it, a) in enumerate(zip(items, arrivals))]
        self._last: dict[int, float] = {}

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def start(self, i: int, at: float | None = None) -> None:
        self.records[i].start_s = self.now() if at is None else at

    def tokens(self, i: int, n: int, at: float) -> None:
        """n new tokens of request i observed at benchmark time `at`."""
        rec = self.records[i]
        if n <= 0:
            return
        if i not in self._last:
            rec.ttft_s = at - rec.arrival_s
        else:
            rec.itl_s.append(at - self._last[i])
        self._last[i] = at
        rec.output_tokens += n

    def finish(self, i: int, at: float, ok: bool = True, error: str = "") -> None:
        rec = self.records[i]
        rec.success, rec.error = ok and rec.output_tokens > 0, error or ("" if rec.output_tokens else "no tokens")
        # NOTE: offline latencies count from the scheduled arrival, so queueing before a batch
        # slot frees up is part of TTFT and E2E (the serve harness sees the same as server time).
        rec.e2e_s = at - rec.arrival_s if rec.ttft_s is not None else None


def wait_until(clock: TokenClock, t: float) -> None:
    d = t - clock.now()
    if d > 0:
        time.sleep(d)


def run_llmbus(model_dir: str, items: list[BenchItem], arrivals: ArrivalProcess, seed: int, *,
               ignore_eos: bool, temperature: float, engine_kwargs: dict, warmup: list[BenchItem] = (),
               progress: bool = True, top_p: float = 1.0) -> tuple[list[RequestRecord], float, float]:
    """Drives llmbus.engine.llm.LLM. With its step-level `engine` attribute each token is timed;
    otherwise one `generate` call times the batch as a whole."""
    from llmbus.engine.llm import LLM
    from llmbus.engine.sampling_params import SamplingParams

    llm = LLM(model_dir, **engine_kwargs)
    if warmup:  # unmeasured
        llm.generate([it.prompt_token_ids for it in warmup],
                     [SamplingParams(max_tokens=it.output_len, temperature=0.0, ignore_eos=True) for it in warmup])
    params = [SamplingParams(max_tokens=it.output_len, temperature=temperature, top_p=top_p, ignore_eos=ignore_eos,
                             seed=seed + i)
              for i, it in enumerate(items)]
    schedule = arrivals.schedule(len(items), seed)
    bar = Progress(len(items), "bench offline", enabled=progress)
    engine = getattr(llm, "engine", None)
    cpu0 = time.process_time()
    clock = TokenClock(items, schedule)
    if engine is None or not hasattr(engine, "step"):
        wait_until(clock, 0.0)
        outs = llm.generate([it.prompt_token_ids for it in items], params)
        at = clock.now()
        for i, out in enumerate(outs):
            clock.start(i)
            clock.tokens(i, len(out.token_ids), at)
            clock.records[i].cached_tokens = out.num_cached_tokens
            clock.finish(i, at, ok=out.finish_reason != "abort", error="aborted" if out.finish_reason == "abort" else "")
            bar.update(clock.records[i].success)
    else:
        pending = deque(range(len(items)))
        ids = {}
        while pending or engine.has_unfinished():
            while pending and schedule[pending[0]] <= clock.now():
                i = pending.popleft()
                rid = f"bench-{i}"
                ids[rid] = i
                clock.start(i)
                engine.add_request(rid, items[i].prompt_token_ids, params[i])
            if not engine.has_unfinished():
                wait_until(clock, schedule[pending[0]])
                continue
            outs = engine.step()
            at = clock.now()
            for o in outs:
                i = ids[o.request_id]
                clock.tokens(i, len(o.new_token_ids), at)
                if o.finish_reason is not None:
                    clock.records[i].cached_tokens = o.num_cached_tokens
                    clock.records[i].prompt_tokens = o.num_prompt_tokens
                    clock.finish(i, at, ok=o.finish_reason != "abort", error="aborted" if o.finish_reason == "abort" else "")
                    bar.update(clock.records[i].success)
    end = clock.now()
    return clock.records, max(end, 1e-9), time.process_time() - cpu0


def run_hf(model_dir: str, items: list[BenchItem], arrivals: ArrivalProcess, seed: int, *, batch_size: int,
           ignore_eos: bool, temperature: float, dtype: str = "float32", warmup: list[BenchItem] = (),
           progress: bool = True, top_p: float = 1.0) -> tuple[list[RequestRecord], float, float]:
    """Static batching with transformers `generate`: up to `batch_size` arrived requests start
    together and the next batch starts only when the whole batch is done. Tokens are timed per
    decoding step (a request's last token is its own, not the batch's)."""
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    if not progress:  # transformers draws its own bar while it loads the weights
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), local_files_only=True)
    model.eval()
    eos = model.generation_config.eos_token_id
    pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    schedule = arrivals.schedule(len(items), seed)
    bar = Progress(len(items), "bench offline hf", enabled=progress)

    class StepTimes(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kw):
            self.times.append(clock.now())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    if warmup:  # unmeasured: one batch of the first warm-up item
        ids = torch.tensor([warmup[0].prompt_token_ids] * min(batch_size, len(warmup)))
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=warmup[0].output_len,
                           do_sample=False, pad_token_id=pad)
    cpu0 = time.process_time()
    clock = TokenClock(items, schedule)
    pending = deque(range(len(items)))
    while pending:
        wait_until(clock, schedule[pending[0]])
        batch = []
        while pending and len(batch) < batch_size and schedule[pending[0]] <= clock.now():
            batch.append(pending.popleft())
        started = clock.now()
        width = max(items[i].prompt_len for i in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):  # left padding
            ids = items[i].prompt_token_ids
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            mask[row, width - len(ids):] = 1
            clock.start(i, started)
        n_new = max(items[i].output_len for i in batch)
        steps = StepTimes()
        torch.manual_seed(seed + batch[0])
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=n_new,
                                 min_new_tokens=n_new if ignore_eos else 0, do_sample=temperature > 0,
                                 temperature=temperature if temperature > 0 else None, top_k=None,
                                 top_p=top_p if temperature > 0 and top_p < 1 else None,
                                 pad_token_id=pad, stopping_criteria=StoppingCriteriaList([steps]))
        gen = out[:, width:]
        for row, i in enumerate(batch):
            toks = gen[row, : items[i].output_len].tolist()
            if not ignore_eos and eos is not None:
                stops = set(eos if isinstance(eos, list) else [eos])
                cut = next((k + 1 for k, t in enumerate(toks) if t in stops), len(toks))
                toks = toks[:cut]
            for k in range(len(toks)):
                clock.tokens(i, 1, steps.times[k])
            clock.finish(i, steps.times[len(toks) - 1] if toks else clock.now())
            bar.update(clock.records[i].success)
    end = clock.now()
    return clock.records, max(end, 1e-9), time.process_time() - cpu0
