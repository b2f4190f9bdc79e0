"""Turns one step's logits into one token per sequence: penalties, greedy or warped random draws.

Per row, in order: repetition penalty (HF convention, over prompt + output tokens), presence and
frequency penalties (OpenAI convention, over output tokens), the request's logit bias, its guide
(tokens that cannot continue the guided JSON get -inf; ``llmbus.guide``), then argmax (temperature 0) or
temperature, top-k, top-p, min-p (each as the transformers logits warper of the same name) and a
draw by the exponential race ``argmax(probs / Exponential(1))``. On CPU the warp and the race run
in C (``llmbus.kernels.cpu_native.sample``: thresholds by radix selection instead of a sort, the same race
in logs, ``argmax(logits + Gumbel)``, its uniforms a counter-based hash of a per-row key); elsewhere
(or without the C library) ``warp_logits`` and torch's generator serve.

Seeds are stateless: a seeded row's randomness at a step comes only from ``(seed, number of output
tokens so far)``, so the same request gives the same tokens whatever shares its batch, in whatever
order, and whichever worker process (of the same device type, with the same path) continues it.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch

from llmbus.kernels import cpu_native
from llmbus.engine.sampling_params import SamplingParams
from llmbus.engine.sequence import Sequence, TokenLogprob
from llmbus.guide.masks import GuideMasks, GuideRun

# Temperatures below this are treated as greedy: dividing by them overflows float32 logits.
GREEDY_EPS = 1e-5
_MASK64 = (1 << 64) - 1


def _exponential(shape, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """Exp(1) draws as -log(U), U ~ U[0, 1): the distribution of ``Tensor.exponential_``, whose CPU
    kernel is scalar (10.2 vs 2.0 ms for a 32 x 16,384 batch). U = 0 gives +inf: that token cannot
    win this draw (probability 2^-24 per entry)."""
    return torch.rand(shape, device=device, generator=generator).log_().neg_()


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None where the row's params.logprobs is None


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """The generator seed for a seeded request's draw after ``step`` output tokens."""
    return _splitmix64((_splitmix64(seed & _MASK64) + step) & _MASK64)


def needs_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _column(values: list, like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=like.device).unsqueeze(1)


def _check_ids(ids: torch.Tensor, seqs: list[Sequence]) -> None:
    if ids.numel() and int(ids.min()) < 0:
        bad = [s.request_id for s in seqs if any(t < 0 for t in s.all_token_ids)]
        raise ValueError(f"negative token id in request(s) {bad}")


def apply_penalties(
    logits: torch.Tensor, seqs: list[Sequence], prompt_cache: weakref.WeakKeyDictionary | None = None
) -> torch.Tensor:
    """Returns penalised copies of ``logits`` [B, V] (row i for seqs[i]); the input is not modified.

    Repetition: a logit of any token seen in prompt or output is divided by the penalty when
    positive and multiplied when negative. Presence/frequency: ``logit -= presence * (count > 0)
    + frequency * count`` over output tokens. Token ids >= V are ignored (as transformers does).
    ``prompt_cache`` (Sequence -> device tensor of prompt ids) saves re-uploading prompts each step.

    Only the entries of tokens that occur are touched (deduplicated per row by one ``unique`` over
    ``row * V + id``): a dense ``[B, V]`` mask and counts cost 10 ms for 32 rows of 16,384 and ~60
    ms for 128,256, where the tokens themselves are a few hundred per row.
    """
    b, v = logits.shape
    dev = logits.device
    prompts = []
    for s in seqs:
        cached = prompt_cache.get(s) if prompt_cache is not None else None
        # NOTE: prompt_token_ids never change after admission; the length check guards misuse.
        if cached is None or cached.numel() != len(s.prompt_token_ids) or cached.device != dev:
            cached = torch.tensor(s.prompt_token_ids, dtype=torch.long, device=dev)
            if prompt_cache is not None:
                prompt_cache[s] = cached
        prompts.append(cached)
    out_ids = torch.tensor([t for s in seqs for t in s.output_token_ids], dtype=torch.long, device=dev)
    out_rows = torch.arange(b, device=dev).repeat_interleave(
        torch.tensor([len(s.output_token_ids) for s in seqs], device=dev)
    )
    prompt_rows = torch.arange(b, device=dev).repeat_interleave(
        torch.tensor([p.numel() for p in prompts], device=dev)
    )
    all_ids = torch.cat(prompts + [out_ids])
    _check_ids(all_ids, seqs)
    out = logits.clone()
    flat = out.view(-1)
    rep = _column([s.params.repetition_penalty for s in seqs], logits, logits.dtype).squeeze(1)
    rows = torch.cat([prompt_rows, out_rows])
    inside = all_ids < v
    seen = torch.unique(rows[inside] * v + all_ids[inside])  # each (row, token) once
    x, r = flat[seen], rep[seen // v]
    flat[seen] = torch.where(x < 0, x * r, x / r)
    inside = out_ids < v
    counted, counts = torch.unique(out_rows[inside] * v + out_ids[inside], return_counts=True)
    pres = _column([s.params.presence_penalty for s in seqs], logits, logits.dtype).squeeze(1)
    freq = _column([s.params.frequency_penalty for s in seqs], logits, logits.dtype).squeeze(1)
    rows = counted // v
    flat[counted] = flat[counted] - pres[rows] - freq[rows] * counts.to(logits.dtype)
    return out


def warp_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p filtering, row i by params[i] (none greedy).

    Each step matches the transformers warper of the same name (ties at the top-k boundary are
    kept; top-p keeps the smallest high-probability set whose mass exceeds top_p; min-p drops tokens
    below ``min_p * max prob``; the most likely token always survives). Filtered logits are -inf.
    """
    temps = _column([p.temperature for p in params], logits, logits.dtype)
    x = logits / temps
    v = x.shape[1]
    ks = [p.top_k if 0 < p.top_k < v else v for p in params]
    do_k = any(k < v for k in ks)
    do_p = any(p.top_p < 1.0 for p in params)
    do_min = any(p.min_p > 0.0 for p in params)
    if not (do_k or do_p or do_min):
        return x
    # NOTE: one ascending sort serves all three filters; masking keeps the order, so position -1
    # always holds the most likely token, which is never removed.
    srt, idx = x.sort(dim=-1)
    remove = torch.zeros_like(srt, dtype=torch.bool)
    if do_k:
        kth = srt.gather(1, v - _column(ks, x, torch.long))
        remove |= srt < kth
    if do_p:
        cum = srt.masked_fill(remove, float("-inf")).softmax(-1).cumsum(-1)
        remove |= cum <= 1.0 - _column([p.top_p for p in params], x, x.dtype)
        remove[:, -1] = False
    if do_min:
        probs = srt.masked_fill(remove, float("-inf")).softmax(-1)
        remove |= probs < _column([p.min_p for p in params], x, x.dtype) * probs[:, -1:]
        remove[:, -1] = False
    return x.masked_fill(remove.scatter(1, idx, remove), float("-inf"))


class Sampler:
    """Samples one token per row of a step's logits; see the module docstring for the pipeline.

    ``seed`` seeds the generator shared by unseeded random rows (None: nondeterministic).
    Logprobs are ``log_softmax`` of the RAW logits, before penalties, temperature and filtering:
    they describe the model's distribution, not the warped one the token was drawn from.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._prompt_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._bias_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # guided decoding: the vocabulary's masks (set by the engine, which has the tokenizer) and
        # each guided sequence's place in its grammar
        self.guides: GuideMasks | None = None
        self._runs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # LLMBUS_CPU_SAMPLER=torch: the torch path on CPU too (for comparison)
        self._native = os.environ.get("LLMBUS_CPU_SAMPLER", "native") != "torch"

    def _bias(self, seq: Sequence, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``seq``'s logit bias as (token ids, biases) on ``device``, built once per sequence."""
        cached = self._bias_cache.get(seq)
        if cached is None or cached[0].device != device or cached[1].dtype != dtype:
            tokens, biases = zip(*seq.params.logit_bias)
            cached = (torch.tensor(tokens, dtype=torch.long).to(device), torch.tensor(biases, dtype=dtype).to(device))
            self._bias_cache[seq] = cached
        return cached

    def _guide(self, x: torch.Tensor, i: int, seq: Sequence) -> None:
        """Row i keeps only the tokens ``seq``'s guide allows next (and its end tokens where the
        guided output may end)."""
        if self.guides is None:
            raise ValueError(f"request {seq.request_id} is guided but this sampler has no vocabulary to guide with")
        run = self._runs.get(seq)
        if run is None or run.spec != seq.params.guide or run.consumed > len(seq.output_token_ids):
            run = self._runs[seq] = GuideRun(seq.params.guide)
        ends = (*seq.eos_token_ids, *seq.params.stop_token_ids)
        self.guides.advance(run, seq.output_token_ids, set(ends))
        allowed, may_end = self.guides.mask(run, x.device)
        if may_end:
            ends = torch.tensor([t for t in ends if t < x.shape[1]], dtype=torch.long, device=x.device)
            allowed = torch.cat([allowed, ends])
        row = x[i]
        kept = torch.full_like(row, float("-inf"))
        kept[allowed] = row[allowed]
        x[i] = kept

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed & _MASK64)
            self._generators[device] = gen
        return gen

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], ahead: list[int] | None = None) -> SamplerOutput:
        """``ahead``: per row, how many outputs past its sequence's the row draws (a speculative
        draft's rows: row ``j`` after a draft's first draws output ``len(output_token_ids) + j``,
        keyed so for a seeded request); None: none. Rows ahead take no penalty and no guide,
        which would need the draft's tokens as output."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs) or logits.shape[1] == 0:
            raise ValueError(f"logits must be [len(seqs)={len(seqs)}, vocab > 0], got {list(logits.shape)}")
        if ahead is not None:
            if len(ahead) != len(seqs):
                raise ValueError(f"ahead has {len(ahead)} entries for {len(seqs)} rows")
            bad = [s.request_id for s, a in zip(seqs, ahead) if a and (s.params.guide or needs_penalty(s.params))]
            if bad:
                raise ValueError(f"rows ahead of their sequence cannot be penalised or guided: {bad}")
        if not logits.is_floating_point():
            raise ValueError(f"logits must be a floating-point tensor, got {logits.dtype}")
        raw = logits.float()
        if not seqs:
            return SamplerOutput([], [])
        x = raw
        pen = [i for i, s in enumerate(seqs) if needs_penalty(s.params)]
        if len(pen) == len(seqs):  # every row: one copy, the penalised one
            x = apply_penalties(raw, seqs, self._prompt_cache)
        elif pen:
            x = raw.clone()
            x[pen] = apply_penalties(raw[pen], [seqs[i] for i in pen], self._prompt_cache)
        biased = [i for i, s in enumerate(seqs) if s.params.logit_bias]
        if biased:
            x = raw.clone() if x is raw else x
            for i in biased:
                cols, values = self._bias(seqs[i], x.device, x.dtype)
                x[i].index_add_(0, cols, values)
        guided = [i for i, s in enumerate(seqs) if s.params.guide]
        if guided:
            x = raw.clone() if x is raw else x
            for i in guided:
                self._guide(x, i, seqs[i])
        rand = [i for i, s in enumerate(seqs) if s.params.temperature >= GREEDY_EPS]
        greedy = self._greedy(x) if not rand and x is raw else None
        if greedy is not None:  # NOTE: all greedy, unpenalised: C finds the tokens and the bad rows
            tokens, token_list = greedy, greedy.tolist()
        else:
            if len(rand) == len(seqs):
                tokens = self._draw(x, seqs, ahead)
            else:
                tokens = x.argmax(dim=-1)  # NOTE: all-greedy batches stop here: one argmax
                if rand:
                    tokens[rand] = self._draw(x[rand], [seqs[i] for i in rand],
                                              None if ahead is None else [ahead[i] for i in rand])
            # A row with no finite maximum (all -inf, +inf or NaN) has no valid token.
            # NOTE: the tokens and the bad rows (as -1) in one read back to the host (on CUDA each
            # read waits for the GPU); logprobs and random rows' fallbacks add their own
            token_list = torch.where(torch.isfinite(raw.amax(dim=-1)), tokens, -1).tolist()
        if min(token_list) < 0:
            ids = [s.request_id for s, t in zip(seqs, token_list) if t < 0]
            raise ValueError(f"logits rows have no finite maximum (all -inf, inf or NaN) for request(s) {ids}")
        return SamplerOutput(token_list, self._logprobs(raw, tokens, token_list, seqs))

    def _greedy(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's first best token, -1 for a row with a NaN or no finite maximum, in C on CPU
        (torch's argmax is a scalar loop there); None where that does not serve."""
        return cpu_native.greedy(x) if self._native and x.device.type == "cpu" else None

    def _draw(self, x: torch.Tensor, seqs: list[Sequence], ahead: list[int] | None = None) -> torch.Tensor:
        """One token per row, by the exponential race: argmax(p / q), q ~ Exp(1) i.i.d."""
        params = [s.params for s in seqs]
        steps = [len(s.output_token_ids) + (ahead[i] if ahead else 0) for i, s in enumerate(seqs)]
        if self._native and x.device.type == "cpu":  # warp and draw in C where it is built
            tokens = cpu_native.sample(x, [p.temperature for p in params], [p.top_k for p in params],
                                       [p.top_p for p in params], [p.min_p for p in params], self._keys(seqs, steps))  # fmt: skip
            if tokens is not None:
                return self._or_best(tokens, tokens < 0, x)
        warped = warp_logits(x, params)
        probs = warped.softmax(dim=-1)
        seeded = [i for i, s in enumerate(seqs) if s.params.seed is not None]
        free = [i for i, s in enumerate(seqs) if s.params.seed is None]
        if not seeded:  # one batched draw from the Sampler's own generator
            q = _exponential(probs.shape, probs.device, self._generator(probs.device))
        else:
            q = torch.empty_like(probs)
        if free and seeded:
            q[free] = _exponential((len(free), probs.shape[1]), probs.device, self._generator(probs.device))
        for i in seeded:  # NOTE: per-row loop only for seeded rows: each needs its own generator
            gen = torch.Generator(device=probs.device)
            gen.manual_seed(step_seed(seqs[i].params.seed, steps[i]))
            q[i] = _exponential((probs.shape[1],), probs.device, gen)
        # NOTE: clamping q keeps 0/q at 0, so a zero-probability token can never win the race.
        tokens = (probs / q.clamp_min(torch.finfo(q.dtype).tiny)).argmax(dim=-1)
        return self._or_best(tokens, warped.amax(dim=-1) == float("-inf"), x)

    @staticmethod
    def _or_best(tokens: torch.Tensor, dead: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rows where nothing stayed finite after the temperature (logits beyond ~3e33 at a tiny
        temperature) cannot be drawn from: the raw logits' best stands in."""
        if bool(dead.any()):
            tokens = torch.where(dead, x.argmax(dim=-1), tokens)
        return tokens

    def _keys(self, seqs: list[Sequence], steps: list[int]) -> list[int]:
        """A 64-bit key per row for ``cpu_native.sample``: a seeded row's from its seed and
        step (``step_seed``; ``steps``: the output each row draws), the others' drawn from the
        Sampler's own generator."""
        free = [i for i, s in enumerate(seqs) if s.params.seed is None]
        keys = [0] * len(seqs)
        if free:
            drawn = torch.randint(-(2**63), 2**63 - 1, (len(free),), dtype=torch.int64,
                                  generator=self._generator(torch.device("cpu"))).tolist()  # fmt: skip
            for i, k in zip(free, drawn):
                keys[i] = k
        for i, s in enumerate(seqs):
            if s.params.seed is not None:
                keys[i] = step_seed(s.params.seed, steps[i])
        return keys

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, tokens: torch.Tensor, token_list: list[int], seqs: list[Sequence]
    ) -> list[TokenLogprob | None]:
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        out: list[TokenLogprob | None] = [None] * len(seqs)
        if not want:
            return out
        entries = logprob_entries(raw[want], tokens[want], [token_list[i] for i in want],
                                  [seqs[i].params.logprobs for i in want])
        for i, entry in zip(want, entries):
            out[i] = entry
        return out


def logprob_entries(raw: torch.Tensor, tokens: torch.Tensor, token_list: list[int], tops: list[int]) -> list[TokenLogprob]:
    """Per row of ``raw`` logits [R, V]: ``log_softmax``'s value at ``tokens[r]`` and its ``tops[r]``
    most likely tokens, as TokenLogprobs (``token_list``: ``tokens`` on the host)."""
    lp = raw.float().log_softmax(dim=-1)
    chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    n_max = min(max(tops), lp.shape[1])
    top_v, top_i = lp.topk(n_max, dim=-1) if n_max else (lp[:, :0], lp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    return [TokenLogprob(token_id=t, logprob=c, top=list(zip(ti[:n], tv[:n])))
            for t, c, ti, tv, n in zip(token_list, chosen, top_i, top_v, tops)]
