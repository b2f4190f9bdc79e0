"""What an engine counts as it steps, for its service's metrics (``llmbus.metrics``): the step's time,
tokens and batch size, tokens computed and generated, prompt tokens read from a prefix cache,
preemptions, requests ended by reason. Updated on the engine thread, read at a scrape. The service
labels them with the model's served name (the engine knows only its directory's).
"""

from __future__ import annotations

from llmbus.metrics import SIZE_BUCKETS, STEP_BUCKETS, Histogram, Metric
from llmbus.protocol import MetricFamily


class EngineStats:
    def __init__(self) -> None:
        m = ()
        self.step_seconds = Histogram(
            "llmbus_engine_step_seconds",
            "An engine step's wall time (schedule, forward, sample), by kind: prefill when it computes a chunk "
            "of more than one token, else decode.", ("kind",), STEP_BUCKETS)
        self.step_tokens = Histogram("llmbus_engine_step_tokens", "Tokens an engine step computes.", m, SIZE_BUCKETS)
        self.step_sequences = Histogram("llmbus_engine_step_sequences", "Sequences in an engine step's batch.",
                                        m, SIZE_BUCKETS)  # fmt: skip
        self.prefill_tokens = Metric(
            "llmbus_engine_prefill_tokens_total",
            "Tokens computed in chunks of more than one token: prompts past their cached prefix, and "
            "recomputes after preemption.", "counter", m)
        self.generation_tokens = Metric("llmbus_engine_generation_tokens_total", "Tokens sampled.", "counter", m)
        self.prompt_tokens = Metric(
            "llmbus_engine_prompt_tokens_total",
            "Prompt tokens of requests whose first token was sampled here.", "counter", m)
        self.cached_tokens = Metric(
            "llmbus_engine_cached_prompt_tokens_total",
            "Of those, prompt tokens read from a prefix cache (this worker's, or kvpool's) instead of computed.",
            "counter", m)
        self.preemptions = Metric("llmbus_engine_preemptions_total",
                                  "Sequences preempted for KV blocks (their tokens are recomputed later).",
                                  "counter", m)  # fmt: skip
        self.draft_tokens = Metric(
            "llmbus_engine_spec_draft_tokens_total",
            "Speculative tokens drafted by n-gram lookup and checked in a decode step.", "counter", m)
        self.accepted_tokens = Metric(
            "llmbus_engine_spec_accepted_tokens_total",
            "Of those, tokens the step confirmed (each the token it sampled there): the tokens speculation saved "
            "a step for.", "counter", m)
        self.finished = Metric(
            "llmbus_engine_requests_finished_total",
            "Requests that left the engine, by reason: stop, length, abort, handoff (a prefill passed to decode), "
            "or error (a step failed on the request alone).",
            "counter", ("reason",))

    def step(self, seconds: float, chunks: list[tuple[int, int]], preempted: int, sampled: int,
             accepted: int = 0) -> None:
        """One step that computed ``chunks`` (per scheduled sequence: its tokens, and how many of
        them were a draft) and yielded ``sampled`` tokens, ``accepted`` of them drafted ones."""
        prefill = sum(n for n, drafted in chunks if n > 1 and not drafted)
        drafted = sum(d for _, d in chunks)
        self.generation_tokens.add(sampled)
        self.step_seconds.observe(seconds, "prefill" if prefill else "decode")
        self.step_tokens.observe(sum(n for n, _ in chunks))
        self.step_sequences.observe(len(chunks))
        if drafted:
            self.draft_tokens.add(drafted)
            self.accepted_tokens.add(accepted)
        if prefill:
            self.prefill_tokens.add(prefill)
        if preempted:
            self.preemptions.add(preempted)

    def first_token(self, prompt: int, cached: int) -> None:
        """A sequence sampled its first output: its prompt's figures count here."""
        self.prompt_tokens.add(prompt)
        self.cached_tokens.add(cached)

    def ended(self, reason: str) -> None:
        self.finished.add(1, reason)

    def families(self) -> list[MetricFamily]:
        parts = (self.step_seconds, self.step_tokens, self.step_sequences, self.prefill_tokens,
                 self.generation_tokens, self.prompt_tokens, self.cached_tokens, self.preemptions,
                 self.draft_tokens, self.accepted_tokens, self.finished)
        return [p.family() for p in parts]
