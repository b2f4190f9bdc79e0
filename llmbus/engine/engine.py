"""The step API: requests in, one batched step at a time, tokens out.

The prefill and decode services drive this; `LLM` wraps it for offline use. Everything here is
synchronous and single-threaded: the services call `step()` from one executor thread.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass, replace

import torch

from llmbus.engine.attention import TorchAttentionBackend
from llmbus.engine.block_manager import BlockManager
from llmbus.engine.config import EngineConfig
from llmbus.engine.runner import ModelRunner
from llmbus.engine.sampler import needs_penalty
from llmbus.engine.sampling_params import SamplingParams
from llmbus.engine.speculative import NgramProposer
from llmbus.guide.masks import GuideMasks, TokenIndex
from llmbus.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput
from llmbus.engine.sequence import Sequence, TokenLogprob
from llmbus.engine.stats import EngineStats
from llmbus.kv.formats import parse_kv_format
from llmbus.kv.layout import DTYPE_BYTES, KVLayout

log = logging.getLogger("llmbus.engine")

# speculative decoding: a step's rows cost by groups (the projections' row blocks): a group's
# later rows cost little beside its first, so drafts fill the last group the decodes started
# (2-vCPU machine, large demo model, 500-token contexts: a step of 8 rows 13.3 ms, of 9 16.9, of
# 16 23.4, of 17 27.0; bf16 on AMX's 16-row tiles, 16 rows 14.0 ms, 17 15.6). On a GPU a group is
# far wider (unmeasured: 64 assumed)
DRAFT_ROW_GROUP_CPU = 8
DRAFT_ROW_GROUP_AMX = 16
DRAFT_ROW_GROUP_CUDA = 64
PROBE_ID = "llmbus-probe"  # the engine's own one-token step, run when a step failed on everything


class OutOfBlocks(ValueError):
    """The cache has too few free blocks for this now; it may have room after later steps."""


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" | "handoff" | "error"
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    # params.prompt_logprobs: with the first token, an entry per prompt token after the first
    prompt_logprobs: list[TokenLogprob] | None = None
    error: str = ""  # finish_reason "error": what the step raised on this sequence alone


def _pick_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {name!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ValueError(f"device {name!r}: this machine's torch sees {count} CUDA device(s)")
    return device


def make_backend(device: torch.device, kv_format: str):
    """The fast SDPA backend (llmbus.kernels.cpu) for model-dtype caches on CPU; otherwise Triton kernels on
    CUDA and the torch references on CPU, for quantized formats where the kernels exist."""
    if device.type == "cpu" and kv_format == "model":
        from llmbus.kernels.cpu import CpuAttentionBackend

        return CpuAttentionBackend()
    try:
        from llmbus.kernels.backends import make_attention_backend
    except ImportError:
        make_attention_backend = None
    if make_attention_backend is not None:
        return make_attention_backend(device.type, kv_format)
    if kv_format != "model":
        raise ValueError(f"kv_format {kv_format!r} needs the quantized-KV backends in llmbus/kernels/, which are not installed")
    return TorchAttentionBackend()


class Engine:
    def __init__(self, loaded, config: EngineConfig) -> None:
        """``loaded`` is a ``llmbus.model.loader.LoadedModel`` already on ``config.device``."""
        self.config = config
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = tuple(loaded.eos_token_ids)
        self.vocab_size = loaded.config.vocab_size
        self.device = next(self.model.parameters()).device
        model_len = loaded.config.max_model_len
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        self.layout: KVLayout = loaded.config.kv_layout(config.block_size, dtype)
        self.kv_format = parse_kv_format(config.kv_format)
        num_blocks = config.num_blocks or self._blocks_for_budget()
        if num_blocks * config.block_size < self.max_model_len:
            log.warning("the KV cache holds %d tokens (%d blocks of %d), under the %d-token context: a sequence "
                        "that outgrows it ends with finish_reason 'length'", num_blocks * config.block_size,
                        num_blocks, config.block_size, self.max_model_len)
        if config.max_model_len and config.max_model_len > model_len:
            log.warning("max_model_len %d exceeds the model's %d positions; using %d", config.max_model_len,
                        model_len, model_len)
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            model_id=loaded.model_id,
            kv_format=config.kv_format,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=max(config.max_num_batched_tokens, 1 if config.enable_chunked_prefill else self.max_model_len),
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
            ),
            self.block_manager,
        )
        self.backend = make_backend(self.device, config.kv_format)
        self.model.backend = self.backend  # caches come from this backend, so attention must too
        self.runner = ModelRunner(self.model, self.layout, self.backend, num_blocks, self.device,
                                  micro_batches=config.cpu_micro_batches, tail_rows=self._num_tail_rows(),
                                  decode_graphs=config.max_num_seqs if self._records_graphs() else 0,
                                  max_model_len=self.max_model_len)
        if self.runner.tails is not None:
            self.block_manager.on_free = self.runner.tails.release
        self.proposer: NgramProposer | None = None
        if config.speculative_tokens:
            if self.kv_format.rewrites_slots:
                self.proposer = NgramProposer(config.speculative_tokens, *config.speculative_ngram)
                self.scheduler.drafter = self._draft
                group = DRAFT_ROW_GROUP_CUDA if self.device.type == "cuda" else self._cpu_row_group()
                self.scheduler.draft_max_rows = config.speculative_max_rows or 4 * group
                self.scheduler.draft_row_group = group
            else:
                log.warning("speculative decoding needs a KV format whose slots can be written again (model, "
                            "int8), not %s: decoding without drafts", config.kv_format)
        self._seqs: dict[str, Sequence] = {}
        # request id -> the tokens the step now running computes for it (replaced whole, never
        # changed in place: other threads read it, through prompt_tokens_left)
        self._in_step: dict[str, int] = {}
        self._guides_lock = threading.Lock()
        self._prefill_only: set[str] = set()
        self._handoffs: dict[str, tuple[dict, torch.Tensor]] = {}
        self.num_preemptions = 0
        self.stats = EngineStats()
        self.isolate_failures = True  # a step that raises fails only the sequences it fails on alone
        # a sequence preempted for blocks waits to resume (as of the last step or abort; other threads
        # read it): imports wait until it has its blocks back, or a stream of them could starve it
        self.resuming = False
        self._evicted: list[tuple[bytes, bytes, torch.Tensor]] = []  # filled once keep_evicted() is on
        if config.warmup or (config.warmup is None and self.device.type == "cuda"):
            try:
                self.warmup()
            except Exception as exc:  # noqa: BLE001 - the engine is left clean; the first requests compile instead
                if type(exc).__name__ == "OutOfResources":  # Triton's: every step would fail the same way
                    lay = self.layout
                    need, limit = getattr(exc, "required", "?"), getattr(exc, "limit", "?")
                    raise ValueError(
                        f"the attention kernels for --kv-format {config.kv_format} at head_dim {lay.head_dim} and "
                        f"--block-size {lay.block_size} need {need} bytes of GPU {getattr(exc, 'name', 'resources')} "
                        f"a program, over this GPU's {limit}: this model and KV format cannot run on it"
                    ) from exc
                log.exception("the warm-up steps failed: kernels compile in the first requests instead")

    @classmethod
    def from_model_dir(cls, model_dir: str, config: EngineConfig | None = None) -> "Engine":
        from llmbus.model.loader import load_model

        config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = _pick_device(config.device)
        loaded = load_model(model_dir, dtype=config.dtype, device=str(device))
        if config.pack_cpu_weights:  # NOTE: here, not in __init__: this model is ours alone
            loaded.model.pack_cpu_weights()
        return cls(loaded, config)

    def _records_graphs(self) -> bool:
        """``cuda_graphs`` where decode steps can be recorded: the Triton backend (on CUDA; on CPU
        only under the interpreter, the tests' case) and no host read in the forward (dynamic
        rope scaling decides per step whether positions passed the trained length). The default
        (None) is on CUDA only, and says nothing where it does not apply."""
        asked = self.config.cuda_graphs
        if asked is False or (asked is None and self.device.type != "cuda"):
            return False
        if getattr(self.backend, "name", "") != "triton":
            if asked:
                log.warning("--cuda-graphs needs CUDA (the Triton attention backend): ignored on %s", self.device)
            return False
        if self.loaded.config.rope.rope_type == "dynamic":
            log.log(logging.WARNING if asked else logging.INFO,
                    "CUDA graphs are not supported with dynamic rope scaling: decode steps run eagerly")
            return False
        return True

    def _num_tail_rows(self) -> int:
        """Exact tail rows the KV format keeps: two per sequence that may run at once
        (``LLMBUS_KV_TAILS=0``: none, blocks seal from their per-token codes; for comparison)."""
        keeps = self.kv_format.tail_row_bytes(self.layout) > 0
        keeps = keeps and os.environ.get("LLMBUS_KV_TAILS", "1") != "0"
        return 2 * self.config.max_num_seqs if keeps else 0

    def _blocks_for_budget(self) -> int:
        """Blocks that fit ``kv_cache_bytes`` once the tail rows are paid for."""
        per_block = self.kv_format.bytes_per_block(self.layout)
        tails = self._num_tail_rows() * self.kv_format.tail_row_bytes(self.layout)
        wanted = self.config.max_num_seqs * -(-self.max_model_len // self.config.block_size) + 1
        return max(2, min(max(0, self.config.kv_cache_bytes - tails) // per_block, wanted))

    # --- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str = "",
        prefill_only: bool = False,
        priority: int = 0,
        output_token_ids: list[int] = (),
    ) -> None:
        """Queue a request; ``priority``: smaller runs first (admitted before, preempted after, the
        waiting and running requests of a larger one). ``output_token_ids``: what it generated
        before, elsewhere (a request resumed from a worker that stopped): computed again as context,
        as a preempted sequence's are, and counted against ``max_tokens``; the next token is its
        first output here."""
        if request_id in self._seqs or request_id in self._handoffs:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_prompt(prompt_token_ids, len(output_token_ids))
        self._check_vocabulary(output_token_ids, "output token")
        if output_token_ids and len(output_token_ids) >= params.max_tokens:
            raise ValueError(f"{len(output_token_ids)} tokens already generated leave none of max_tokens "
                             f"{params.max_tokens}")  # fmt: skip
        self._check_params(params)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            eos_token_ids=self.eos_token_ids,
            cache_salt=cache_salt,
            priority=priority,
            output_token_ids=list(output_token_ids),
        )
        self._seqs[request_id] = seq
        if prefill_only:
            self._prefill_only.add(request_id)
        self.scheduler.add(seq)

    def check_prompt(self, prompt_token_ids: list[int], extra: int = 0) -> None:
        """A prompt (followed by ``extra`` tokens already generated, for an imported sequence) that
        leaves room to generate one more token, in the context and in the cache."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty: at least one token is needed")
        if n + extra >= self.max_model_len:
            what = f"the prompt has {n} tokens" + (f" and {extra} generated" if extra else "")
            raise ValueError(
                f"{what} but the model's context is {self.max_model_len} tokens "
                "(at least one must be left to generate)"
            )
        self._check_vocabulary(prompt_token_ids)
        needed = self.layout.num_blocks_for(n + 1 + extra)
        if needed > self.runner.num_blocks:
            raise ValueError(
                f"the prompt needs {needed} KV blocks but this engine has only {self.runner.num_blocks}"
            )

    def _check_params(self, params: SamplingParams) -> None:
        """What a request's sampling parameters need of this engine: its vocabulary, and for a guide
        the tokenizer (the sampler's masks are built from it on the first guided request)."""
        self._check_vocabulary([t for t, _ in params.logit_bias], "logit_bias")
        if params.guide and self.runner.sampler.guides is None:
            if self.tokenizer is None:
                raise ValueError("guided decoding (JSON output) needs the model's tokenizer.json, which this model directory lacks")
            self.prepare_guides()

    def prepare_guides(self) -> None:
        """Build the sampler's guided-decoding index of the vocabulary (about a second for 150k
        tokens), with the tables of a ``.`` run (``TokenIndex.runs.warm``). Workers call this at
        startup on a thread of its own, so the first guided request does not stall every running
        one; otherwise that request builds it."""
        with self._guides_lock:
            if self.runner.sampler.guides is None and self.tokenizer is not None:
                index = TokenIndex.from_tokenizer(self.tokenizer)
                index.runs.warm()
                self.runner.sampler.guides = GuideMasks(index)

    def _check_vocabulary(self, token_ids: list[int], what: str = "token") -> None:
        bad = [t for t in token_ids if type(t) is not int or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what} id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})")

    def abort(self, request_id: str) -> bool:
        """Stop a request, or drop a finished prefill's KV awaiting export; whether there was one."""
        handoff = self._handoffs.pop(request_id, None)
        seq = self._seqs.pop(request_id, None)
        self._prefill_only.discard(request_id)
        if seq is None:
            return handoff is not None
        self.scheduler.abort(request_id)
        self.resuming = self.scheduler.waiting_to_resume()  # NOTE: an idle engine takes no step to update it
        self.stats.ended("abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def warmup(self) -> None:
        """Run the kinds of step serving runs (a prompt alone; decodes beside a prompt, with short
        and longer contexts; decodes alone; a prompt as long as a step's token budget) on dummy
        prompts, so the kernels they launch compile now and not in the first requests (on a GPU,
        Triton compiles each variant at its first launch: about a second each on the H200's host),
        and a whole step's activations have been allocated once (on CPU, the first 2,048-token
        step of the large demo model took ~420 ms instead of ~270 while its fresh pages faulted in;
        the allocator keeps them after). Leaves nothing behind: no request, no block held, nothing
        indexed for prefix reuse. Skipped while requests are in flight or where the pool cannot
        hold the dummy prompts (the full-budget one alone: only it)."""
        bm = self.block_manager
        long = min(140, self.max_model_len - 4)  # past one 128-token tile (int8's): decode splits it
        plan = [(5, 4), (long, 3), (5, 2)]  # (prompt tokens, output tokens), one added a step
        if self.has_unfinished() or long < 6 or sum(bm.blocks_for(p + o) for p, o in plan) > bm.num_free_blocks:
            return
        big = min(self.config.max_num_batched_tokens, self.max_model_len - 1)
        caching, bm.enable_prefix_caching = bm.enable_prefix_caching, False
        ids = [f"llmbus-warmup-{i}" for i in range(len(plan) + 1)]
        self.isolate_failures = False  # NOTE: a kernel that cannot run must raise here, not end the dummies
        try:
            for rid, (p, o) in zip(ids, plan):
                prompt = [1 + i % (self.vocab_size - 1) for i in range(p)]
                self.add_request(rid, prompt, SamplingParams(max_tokens=o, temperature=0, ignore_eos=True))
                self.step()
            while self.has_unfinished():
                self.step()
            if big > long and bm.blocks_for(big + 1) <= bm.num_free_blocks:
                prompt = [1 + i % (self.vocab_size - 1) for i in range(big)]
                self.add_request(ids[-1], prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
                while self.has_unfinished():
                    self.step()
        finally:
            self.isolate_failures = True
            bm.enable_prefix_caching = caching
            for rid in ids:
                self.abort(rid)
            self.stats = EngineStats()  # the dummy requests are not the service's figures

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def _cpu_row_group(self) -> int:
        """Decode rows a CPU step pays for together: AMX's tiles take 16 (bf16, blocked weights)."""
        from llmbus.model.cpu_linear import amx_bf16

        bf16 = next(self.model.parameters()).dtype == torch.bfloat16
        return DRAFT_ROW_GROUP_AMX if bf16 and self.config.pack_cpu_weights and amx_bf16() else DRAFT_ROW_GROUP_CPU

    # --- stepping -----------------------------------------------------------------------------

    def _draft(self, seq: Sequence, share: int, most: int) -> list[int]:
        """``seq``'s speculative draft (the scheduler's ``drafter``): none for a prefill handing
        off after its first token, nor where the sampler would need the draft as output
        (penalties, a guide)."""
        p = seq.params
        if seq.request_id in self._prefill_only or p.guide or needs_penalty(p):
            return []
        return self.proposer.propose(seq, share, most)

    def prompt_tokens_left(self, request_id: str) -> int | None:
        """Tokens of the request's context the engine has yet to compute before it samples next:
        neither computed (prefix-cache hits count as computed once it is scheduled) nor in the
        step running now; None for a request it does not hold. Safe to call from any thread: a
        snapshot, which may count the running step's tokens as it ends, never drop them early."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        return max(0, seq.num_tokens - seq.num_computed_tokens - self._in_step.get(request_id, 0))

    def step(self) -> list[StepOutput]:
        start = time.perf_counter()
        out = self.scheduler.schedule()
        self.num_preemptions += len(out.preempted)
        self.resuming = self.scheduler.waiting_to_resume()  # (only schedule() changes who waits)
        stats = self.stats
        results: list[StepOutput] = []
        for seq in out.rejected:  # can never fit this engine: finished without a token
            self._seqs.pop(seq.request_id, None)
            self._prefill_only.discard(seq.request_id)
            results.append(self._output(seq, [], None, seq.finish_reason or "length"))
            stats.ended(results[-1].finish_reason)
        if not out.scheduled:
            return results
        chunks = [(s.num_new_tokens, len(s.draft)) for s in out.scheduled]
        self._in_step = {s.seq.request_id: s.num_new_tokens for s in out.scheduled}
        try:
            sampled, failed = self._execute(out) if self.isolate_failures else (self.runner.execute(out), [])
        finally:
            self._in_step = {}  # NOTE: before update() counts them computed: a reader may count them twice, never not at all
        if failed:
            out = self._fail(out, failed, results)
        before = {rid: (len(seq.output_token_ids), len(seq.output_logprobs))
                  for rid in sampled if (seq := self._seqs.get(rid)) is not None}  # fmt: skip
        self.scheduler.update(out, sampled)
        generated = accepted = 0
        drafted = {e.seq.request_id: e.draft for e in out.scheduled if e.draft}
        for request_id, (n_out, n_lp) in before.items():
            seq = self._seqs[request_id]
            reason = seq.finish_reason
            if request_id in self._prefill_only and reason is None:
                self._handoffs[request_id] = self._export(seq)
                self.scheduler.abort(request_id)
                reason = "handoff"
            tokens = seq.output_token_ids[n_out:]
            logprobs = seq.output_logprobs[n_lp:] if seq.params.logprobs is not None else None
            results.append(self._output(seq, tokens, logprobs, reason))
            generated += len(tokens)
            if request_id in drafted:
                accepted += len(tokens) - 1
                self.proposer.checked(seq, len(drafted[request_id]), len(tokens) - 1)
            if n_out == 0:
                stats.first_token(seq.num_prompt_tokens, seq.num_cached_tokens)
            if reason is not None:
                self._seqs.pop(request_id, None)
                self._prefill_only.discard(request_id)
                stats.ended(reason)
        stats.step(time.perf_counter() - start, chunks, len(out.preempted), generated, accepted)
        return results

    def _execute(self, out: SchedulerOutput) -> tuple[dict[str, tuple[int, TokenLogprob | None]], list]:
        """Run the step; where it raises, run it again in halves, down to single sequences (each
        tried twice): the tokens sampled, and ``(sequence, exception)`` for each sequence the step
        fails on alone. A step that fails on every sequence it ran may be the engine's fault, not
        theirs (a dead device, kernels that cannot launch; or copies of one bad request): the
        engine then runs a step of its own (``_healthy``), and where that fails too, raises the
        first exception, ending nobody (their jobs go to another replica).

        NOTE: a failed attempt leaves nothing behind that the retry does not redo: it computes the
        same positions into the same cache slots (on CPU in float32 bit for bit; on a GPU a smaller
        batch may take other kernels), scores prompt tokens not yet scored, a guide's state follows
        the sequence's output, and seeded draws are stateless. The exact tail rows' bookkeeping is
        put back as it was. Unseeded rows draw again from the shared generator."""
        sampled, failed = self._bisect(out)
        if failed and len(failed) == len(out.scheduled) and not self._healthy():
            raise failed[0][1]
        return sampled, failed

    def _healthy(self) -> bool:
        """Whether the engine still runs a step: a one-token prompt of its own, computed and
        sampled alone, then dropped. Assumed where no block is free for it."""
        seq = Sequence(request_id=PROBE_ID, prompt_token_ids=[1 % self.vocab_size],
                       params=SamplingParams(max_tokens=1, temperature=0.0))  # fmt: skip
        if not self.block_manager.allocate(seq, 1):
            return True
        try:
            self.runner.execute(SchedulerOutput([ScheduledSeq(seq, 1, True)], [], 1))
            return True
        except Exception:  # noqa: BLE001 - broken, whatever it says
            log.exception("the engine's own step failed too: the engine is broken")
            return False
        finally:
            self.block_manager.free(seq)

    def _bisect(self, out: SchedulerOutput, tries: int = 2) -> tuple[dict[str, tuple[int, TokenLogprob | None]], list]:
        tails = self.runner.tails
        held = tails.snapshot() if tails is not None else None
        try:
            return self.runner.execute(out), []
        except Exception as exc:  # noqa: BLE001 - whatever it is, it is run again smaller, or raised
            if held is not None:
                tails.restore(held)
            if len(out.scheduled) == 1:
                return self._bisect(out, tries - 1) if tries > 1 else ({}, [(out.scheduled[0].seq, exc)])
            half = len(out.scheduled) // 2
            sampled, failed = self._bisect(replace(out, scheduled=out.scheduled[:half]))
            more, failed_too = self._bisect(replace(out, scheduled=out.scheduled[half:]))
            return sampled | more, failed + failed_too

    def _fail(self, out: SchedulerOutput, failed: list, results: list[StepOutput]) -> SchedulerOutput:
        """End each failed sequence with "error" (its blocks freed, its output in ``results``);
        ``out`` without them."""
        gone = set()
        for seq, exc in failed:
            log.error("the step failed on %s alone; ending it", seq.request_id, exc_info=exc)
            gone.add(seq.request_id)
            self.scheduler.finish(seq, "error")
            self._seqs.pop(seq.request_id, None)
            self._prefill_only.discard(seq.request_id)
            results.append(replace(self._output(seq, [], None, "error"),
                                   error=f"the engine failed on this request: {type(exc).__name__}: {exc}"))
            self.stats.ended("error")
        return replace(out, scheduled=[e for e in out.scheduled if e.seq.request_id not in gone])

    @staticmethod
    def _output(seq: Sequence, tokens: list[int], logprobs, reason: str | None) -> StepOutput:
        first = len(seq.output_token_ids) == len(tokens) == 1
        return StepOutput(
            request_id=seq.request_id,
            new_token_ids=tokens,
            logprobs=logprobs,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=len(seq.output_token_ids),
            prompt_logprobs=seq.prompt_logprobs if first and seq.params.prompt_logprobs is not None else None,
        )

    # --- disaggregation -----------------------------------------------------------------------

    def _export(self, seq: Sequence) -> tuple[dict, torch.Tensor]:
        """State and KV rows of a sequence handed off: its blocks, then (a format that keeps tail
        rows, a filling block) that block's exact keys and values packed into rows of their own
        (``tail_tokens`` of them, ``pack_tail``)."""
        n_blocks = self.layout.num_blocks_for(seq.num_computed_tokens)
        kv = self.read_blocks(seq.block_table[:n_blocks])
        state = {
            "request_id": seq.request_id,
            "prompt_token_ids": list(seq.prompt_token_ids),
            "output_token_ids": list(seq.output_token_ids),
            "num_computed_tokens": seq.num_computed_tokens,
            "num_cached_tokens": seq.num_cached_tokens,
            "cache_salt": seq.cache_salt,
            "block_size": self.layout.block_size,
        }
        exact = self.runner.exact_tail(seq.request_id, seq.num_computed_tokens % self.layout.block_size)
        if exact is not None:
            kv = torch.cat((kv, pack_tail(exact.cpu(), kv.shape[2])))
            state["tail_tokens"], state["tail_dtype"] = exact.shape[2], self.layout.dtype
        return state, kv

    def export_sequence(self, request_id: str) -> tuple[dict, torch.Tensor]:
        """State and KV of a request that finished with ``"handoff"``; its blocks are already free."""
        try:
            return self._handoffs.pop(request_id)
        except KeyError:
            raise ValueError(f"no handed-off request {request_id!r}") from None

    def import_sequence(self, state: dict, kv: torch.Tensor, params: SamplingParams, priority: int = 0) -> None:
        """Join a sequence computed elsewhere: copy its KV into fresh blocks, continue decoding
        (``priority`` as ``add_request``'s)."""
        request_id = state["request_id"]
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        if state["block_size"] != self.layout.block_size:
            raise ValueError(f"handoff block size {state['block_size']} != engine block size {self.layout.block_size}")
        prompt = list(state["prompt_token_ids"])
        outputs = list(state["output_token_ids"])
        self.check_prompt(prompt, extra=len(outputs))
        self._check_vocabulary(outputs)
        self._check_params(params)
        salt = state.get("cache_salt", "")
        computed, cached = state["num_computed_tokens"], state.get("num_cached_tokens", 0)
        if not isinstance(salt, str):
            raise ValueError(f"handoff cache_salt must be a string, got {type(salt).__name__}")
        if type(computed) is not int or not 0 < computed < len(prompt) + len(outputs):  # the last token has no KV
            raise ValueError(f"handoff has {computed!r} computed tokens for {len(prompt) + len(outputs)} tokens")
        if type(cached) is not int or not 0 <= cached <= len(prompt):
            raise ValueError(f"handoff has {cached!r} cached tokens for a {len(prompt)}-token prompt")
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=params,
            eos_token_ids=self.eos_token_ids,
            cache_salt=salt,
            output_token_ids=outputs,
            priority=priority,
        )
        n_blocks = self.layout.num_blocks_for(computed)
        tail_tokens, tail_dtype = int(state.get("tail_tokens", 0)), state.get("tail_dtype", self.layout.dtype)
        if (tail_tokens not in (0, computed % self.layout.block_size) or tail_dtype not in DTYPE_BYTES
                or tail_tokens and not self.kv_format.keeps_tails):
            raise ValueError(f"handoff tail of {tail_tokens} {tail_dtype} tokens for {computed} computed tokens "
                             f"in {self.layout.block_size}-token {self.config.kv_format} blocks")
        layer_bytes = self.kv_format.bytes_per_block(self.layout) // self.layout.num_layers
        n_rows = n_blocks + self._tail_rows_for(tail_tokens, tail_dtype, layer_bytes)
        if kv.dim() != 3 or list(kv.shape) != [n_rows, self.layout.num_layers, layer_bytes]:
            raise ValueError(
                f"handoff KV has shape {list(kv.shape)}; expected [{n_rows}, {self.layout.num_layers}, {layer_bytes}] "
                f"for {computed} tokens" + (f" and a tail of {tail_tokens}" if tail_tokens else "")
            )
        if self.scheduler.waiting_to_resume():
            raise OutOfBlocks("sequences preempted for blocks resume before more are imported")
        if not self.block_manager.allocate_computed(seq, computed):
            raise OutOfBlocks("no free KV blocks to import the sequence")
        try:
            self.write_blocks(seq.block_table[:n_blocks], kv[:n_blocks])
            if tail_tokens and self.runner.tails is not None:
                shape = (self.layout.num_layers, 2, tail_tokens, self.layout.num_kv_heads, self.layout.head_dim)
                exact = unpack_tail(kv[n_blocks:], shape, getattr(torch, tail_dtype))
                self.runner.tails.received[request_id] = exact.to(self.device, getattr(torch, self.layout.dtype))
        except BaseException:  # out of device memory, say: the blocks just allocated must not be lost
            self.block_manager.free(seq)
            raise
        seq.num_cached_tokens = cached
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    # --- prefix import / export (kvpool) -------------------------------------------------------

    def _tail_rows_for(self, tail_tokens: int, dtype: str, layer_bytes: int) -> int:
        """Handoff rows of ``layer_bytes`` a layer that a tail of ``tail_tokens`` tokens in ``dtype`` takes."""
        per_layer = 2 * tail_tokens * self.layout.num_kv_heads * self.layout.head_dim * DTYPE_BYTES[dtype]
        return -(-per_layer // max(1, layer_bytes))

    def prefix_hashes(self, token_ids: list[int], cache_salt: str = "") -> list[bytes]:
        """Chained hashes of the full blocks of ``token_ids``, rooted like this engine's own prefix
        cache (model name, KV format, salt), so kvpool and tier 0 name a block the same way."""
        from llmbus.kv.hashing import chain_hashes, root_hash

        bm = self.block_manager
        return chain_hashes(root_hash(bm.model_id, bm.kv_format, cache_salt), list(token_ids), bm.block_size)

    def reusable_prefix_hashes(self, prompt_token_ids: list[int], cache_salt: str = "") -> list[bytes]:
        """The prompt's blocks a cache hit may cover: full blocks, leaving at least the last token
        to compute (its logits give the first output token)."""
        return self.prefix_hashes(prompt_token_ids[: max(0, len(prompt_token_ids) - 1)], cache_salt)

    def local_prefix_blocks(self, hashes: list[bytes]) -> int:
        """Blocks of the chain ``hashes`` this engine's tier-0 cache holds, from the start. Safe to
        call from any thread (membership tests of the hash index, each atomic): a snapshot, which a
        step running meanwhile may make stale."""
        return self.block_manager.cached_prefix_blocks(hashes)

    def import_prefix(self, hashes: list[bytes], kv: torch.Tensor, protect: list[bytes] = ()) -> int:
        """Load cached blocks (``read_blocks`` rows, one per hash) into the prefix cache as computed
        and cached, so a request with this prefix computes only the rest. Returns blocks loaded."""
        if kv.dim() != 3 or kv.shape[0] != len(hashes) or kv.shape[1] != self.layout.num_layers:
            raise ValueError(f"prefix KV has shape {list(kv.shape)}; expected [{len(hashes)}, {self.layout.num_layers}, bytes]")
        ids = self.block_manager.import_cached(hashes, protect)
        if ids:
            self.write_blocks(ids, kv[: len(ids)])
        return len(ids)

    def keep_evicted(self) -> None:
        """From now on, copy every computed prefix block the cache evicts (before it is reused)
        into a list that ``take_evicted`` drains: a write-back of tier 0 to a lower tier.

        NOTE: at most a quarter of the cache's blocks are kept for a caller that stopped draining
        them (the oldest go first), so a stalled write-back costs bounded memory."""
        cap = max(64, self.runner.num_blocks // 4)

        def save(block: int, h: bytes, parent: bytes) -> None:
            self._evicted.append((h, parent, self.read_blocks([block])[0]))
            del self._evicted[:-cap]

        self.block_manager.on_evict = save

    def track_cache_changes(self) -> None:
        """From now on, record what the prefix cache indexes and forgets (``BlockManager.changes``)
        for ``take_cache_changes`` to drain: a worker announces its cache to kvpool's index."""
        self.block_manager.track_changes()

    def take_cache_changes(self) -> list[tuple[bool, bytes, bytes | None]]:
        changes = self.block_manager.changes
        if changes is None:
            return []
        out = list(changes)
        changes.clear()
        return out

    @property
    def num_cache_changes(self) -> int:
        return len(self.block_manager.changes or ())

    @property
    def num_evicted(self) -> int:
        return len(self._evicted)

    def take_evicted(self) -> list[tuple[bytes, bytes, torch.Tensor]]:
        """``(hash, parent hash, read_blocks row)`` of each block evicted since the last call, in
        eviction order (``keep_evicted`` first)."""
        out, self._evicted = self._evicted, []
        return out

    def export_cached(self, hashes: list[bytes], start: int = 0) -> torch.Tensor:
        """``read_blocks`` rows of ``hashes[start:n]``, where ``n`` is how many of the chain this
        engine still caches (consecutive from the start); empty when ``n <= start``."""
        ids = self.block_manager.cached_blocks(hashes)[start:]
        if not ids:
            return torch.zeros((0, self.layout.num_layers, 0), dtype=torch.uint8)
        return self.read_blocks(ids)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Bytes of ``block_ids`` in the cache's own format: uint8 ``[n, num_layers, layer_block_bytes]``,
        so block ``i`` is the contiguous row ``out[i]`` (what kvpool stores as one block)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        rows = [self.backend.read_blocks(cache, idx) for cache in self.runner.kv_caches]
        return torch.stack(rows, dim=1).cpu()

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Inverse of ``read_blocks``."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for layer, cache in enumerate(self.runner.kv_caches):
            self.backend.write_blocks(cache, idx, kv[:, layer].contiguous())

    def leak_check(self) -> dict[str, int]:
        """Counts a test can assert on: zero requests and all blocks free after work ends."""
        return {
            "requests": len(self._seqs),
            "handoffs": len(self._handoffs),
            "free_blocks": self.block_manager.num_free_blocks,
            "total_blocks": self.runner.num_blocks,
            "tail_rows": self.runner.tails.num_held if self.runner.tails is not None else 0,
        }


def pack_tail(exact: torch.Tensor, layer_bytes: int) -> torch.Tensor:
    """A filling block's exact keys and values ``[layers, 2, n, H, D]`` as handoff rows uint8
    ``[rows, layers, layer_bytes]``: each layer's bytes in order over the rows, zero-padded."""
    layers = exact.shape[0]
    flat = exact.contiguous().view(torch.uint8).reshape(layers, -1)
    rows = -(-flat.shape[1] // layer_bytes)
    out = torch.zeros(layers, rows * layer_bytes, dtype=torch.uint8)
    out[:, : flat.shape[1]] = flat
    return out.view(layers, rows, layer_bytes).transpose(0, 1)


def unpack_tail(rows: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``pack_tail``: ``[layers, 2, n, H, D]`` in ``dtype``."""
    flat = rows.transpose(0, 1).reshape(shape[0], -1)
    return flat[:, : math.prod(shape[1:]) * dtype.itemsize].contiguous().view(dtype).reshape(shape)
