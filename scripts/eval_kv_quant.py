"""Accuracy of quantized KV: teacher-forced top-1 agreement and mean KL of int8/int4 vs model-dtype KV.

The model runs token by token (the decode path), so from the second token on every attention
reads the quantized cache, as the engine does for generated tokens: full INT4 blocks per channel,
the filling block's keys and values exactly from the sequence's tail row; each
INT4 block is quantized per channel from those exact keys when its last token arrives.
``--path prefill`` feeds each sequence in one prefill pass instead, as a prompt is (full INT4
blocks quantized per channel from the exact keys in the same pass; the pass attends to its own
keys and values as computed, so its logits are the model dtype's). ``--path mixed`` feeds the
first ``--prompt-tokens`` in one prefill pass and the rest by decode steps, as a request is served,
and scores the decode steps: what the prompt's pass left in the cache, read by generation. The same token sequences are
fed under each format: seeded random ids (``--text random``, the default), or (``--text stdlib``)
windows of the held-out part of the corpus ``scripts/train_demo_model.py``
trains on, which is what a trained demo model should be measured on.

Peaky logits: a random demo model's next-token distribution is almost flat. For the KL, every
position's logits are multiplied by one factor ``alpha``, chosen by bisection so that the
model-dtype reference's mean top-1 probability is ``--target-top1`` (0.5 by default with ``--text
random``), and the same ``alpha`` is applied under every format (``alpha`` acts like an inverse
sampling temperature; top-1 agreement does not depend on it). A trained model's distribution is
its own: with ``--text stdlib`` the default is no scaling (``alpha`` 1; ``--target-top1`` still
asks for one).

Controls (``--controls``): the reference becomes the model in fp32 with fp32 KV, and two rows show
how much a perturbation far smaller than quantization moves the metric: the same fp32 model with
its KV rounded to bf16, and the model run in bf16 throughout. If those disagree a lot, the model
amplifies tiny perturbations and top-1 agreement says little about the KV format. A third row,
INT4 without tail rows, shows what they bring (blocks sealed from their per-token codes, the
filling block read from them).

    python scripts/eval_kv_quant.py [--model-dir DIR | --demo large] [--seqs 2] [--tokens 160] [--controls]
                                    [--text random|stdlib]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmbus.kernels.backends import make_attention_backend  # noqa: E402
from llmbus.engine.attention import build_attention_metadata  # noqa: E402
from llmbus.kv.layout import KVLayout  # noqa: E402


def candidate_backend(device: str, key_group: int, value_group: int | None = None, rotate_values: bool = False):
    """A candidate INT4 format, simulated (not a format of ``llmbus.kv.formats``): keys rotated by
    the head_dim's Hadamard matrix and quantized per token, in groups of ``key_group`` channels,
    like values (``llmbus.kernels.quant_reference.int4_group_quantize``: fp16 scale and minimum a group);
    values as INT4's (``value_group``: in groups of that many channels instead; ``rotate_values``:
    rotated first, as keys). Each token's keys and values are stored as their round trip (rotated
    back) in a model-dtype cache, from the step that writes them: no exact tail rows. Attention
    over rotated keys is the same as over these, with the query rotated too (``q . k = Hq . Hk``),
    which is what a kernel would do: per-token scales then fold into the scores, as INT8's do."""
    from llmbus.kernels import quant_reference as qr
    from llmbus.kernels.backends import TorchPagedAttentionBackend
    from llmbus.kv.formats import KVFormat

    def round_trip(x, group, rotated):
        x = qr.rotate(x.float()) if rotated else x.float()
        x = qr.int4_group_dequantize(*qr.int4_group_quantize(x, group), group)
        return qr.rotate(x) if rotated else x

    class CandidateInt4(TorchPagedAttentionBackend):
        def forward(self, q, k, v, cache, meta, scale):
            gv = value_group or KVFormat.value_group(k.shape[-1])
            kq, vq = round_trip(k, key_group, True), round_trip(v, gv, rotate_values)
            return super().forward(q, kq.to(k.dtype), vq.to(v.dtype), cache, meta, scale)

    return CandidateInt4("model")


def run_logits(model, cfg, kv_format: str, tokens: torch.Tensor, device: str, block_size: int = 16,
               kv_dtype: str | None = None, path: str = "decode", tails: bool = True,
               backend=None, prompt_tokens: int = 0) -> torch.Tensor:
    """Teacher-forced logits ``[S, L, vocab]`` fp32: one decode step per position (``path``
    "decode", how generated tokens are cached), or one prefill pass per sequence ("prefill", how a
    prompt is; it attends to its own K/V as computed, ``llmbus.kernels.reference.exact_chunks``), or
    ("mixed", as a request is served) a prefill pass over the first ``prompt_tokens`` and decode
    steps after them. ``kv_dtype``
    (default: the model's) is the cache dtype of the ``model`` format. ``tails=False``: no exact
    tail rows (INT4 blocks then seal from their per-token codes). ``backend``: this attention backend
    instead of ``kv_format``'s (``candidate_backend``; its cache in the model dtype)."""
    s, n = tokens.shape
    model.backend = backend or make_attention_backend(device, kv_format)
    dtype = kv_dtype or str(next(model.parameters()).dtype).removeprefix("torch.")
    lay = KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size, dtype)
    per_seq = lay.num_blocks_for(n)
    # NOTE: one tail row per sequence is enough here: no step both seals a block and starts the next
    rows = [(i, i) for i in range(s)] if tails else None
    caches = model.backend.allocate_cache(lay, s * per_seq, device, tail_rows=s if tails else 0)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(s)]
    out = []
    first = {"decode": 0, "prefill": n, "mixed": prompt_tokens}[path]
    if path == "mixed" and not 0 < first < n:
        raise ValueError(f"the mixed path needs 0 < prompt_tokens < {n}, got {prompt_tokens}")
    with torch.inference_mode():
        if first:
            prompts = []
            for i, table in enumerate(tables):
                row = None if rows is None else [rows[i]]
                meta, pos = build_attention_metadata([(table, 0, first)], block_size, device, row)
                prompts.append(model.compute_logits(model(tokens[i, :first].to(device), pos, caches, meta)).float().cpu())
            out = list(torch.stack(prompts).unbind(1))
        for t in range(first, n):
            meta, pos = build_attention_metadata([(table, t, 1) for table in tables], block_size, device, rows)
            hidden = model(tokens[:, t].to(device), pos, caches, meta)
            out.append(model.compute_logits(hidden).float().cpu())
    return torch.stack(out, dim=1)


def peaky_alpha(logits: torch.Tensor, target: float) -> float:
    """Factor making the mean top-1 probability of ``softmax(alpha * logits)`` equal ``target``."""
    lo, hi = 0.0, 1.0
    while torch.softmax(hi * logits, -1).amax(-1).mean() < target and hi < 1e6:
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if torch.softmax(mid * logits, -1).amax(-1).mean() < target else (lo, mid)
    return (lo + hi) / 2


def compare(ref: torch.Tensor, got: torch.Tensor, alpha: float) -> dict:
    lp, lq = torch.log_softmax(alpha * ref, -1), torch.log_softmax(alpha * got, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    agree = (ref.argmax(-1) == got.argmax(-1)).float()
    return dict(top1_agreement=float(agree.mean()), mean_kl=float(kl.mean()), max_kl=float(kl.max()))


def eval_tokens(text: str, model_dir: Path, cfg, seqs: int, n: int, seed: int) -> torch.Tensor:
    """``[seqs, n]`` token ids: seeded random ids, or evenly spaced windows of held-out stdlib text."""
    if text == "random":
        return torch.randint(0, cfg.vocab_size, (seqs, n), generator=torch.Generator().manual_seed(seed))
    import platform

    from scripts.train_demo_model import corpus_tokens

    trained = json.loads((model_dir / "config.json").read_text()).get("llmbus_demo_trained", {})
    if trained.get("python", platform.python_version()) != platform.python_version():
        print(f"note: the model was trained on Python {trained['python']}'s standard library, this is "
              f"{platform.python_version()}'s: held-out files may differ", file=sys.stderr)
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else 0
    held = corpus_tokens(model_dir / "tokenizer.json", True, 1 << 40, eos)
    # evenly spaced windows that never overlap, all shifted by a seeded offset (another seed reads other text)
    stride = (len(held) - n) // seqs
    if stride < n:
        raise ValueError(f"the held-out corpus has {len(held)} tokens: too few for {seqs} disjoint windows of {n}")
    shift = int(torch.randint(0, max(1, stride), (1,), generator=torch.Generator().manual_seed(seed)))
    return torch.stack([held[i * stride + shift:i * stride + shift + n] for i in range(seqs)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, help="Hugging Face model directory (default: a demo model)")
    ap.add_argument("--demo", default="large", help="demo model size when --model-dir is not given")
    ap.add_argument("--dtype", default=None, help="load dtype (default: the checkpoint's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--target-top1", type=float, default=None,
                    help="scale logits to this mean top-1 probability (default: 0.5 for --text random, none for stdlib)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--path", choices=("decode", "prefill", "mixed"), default="decode",
                    help="teacher-force by decode steps (the default), by one prefill pass per sequence, or "
                         "(mixed) a prefill pass over --prompt-tokens then decode steps, scored on those steps")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="the mixed path's prompt (default: half of --tokens)")
    ap.add_argument("--text", choices=("random", "stdlib"), default="random",
                    help="random ids, or held-out Python standard library source (for a trained demo model)")
    ap.add_argument("--controls", action="store_true", help="fp32 reference plus bf16-KV and bf16-model control rows")
    ap.add_argument("--candidate-key-groups", default="",
                    help="comma-separated key groups of the simulated rotated per-token INT4 format (candidate_backend) "
                         "to add as rows, e.g. 64,32")
    ap.add_argument("--candidate-value-group", type=int, default=None,
                    help="the simulated candidate's value group (default: int4's)")
    ap.add_argument("--candidate-rotate-values", action="store_true", help="the simulated candidate rotates values too")
    ap.add_argument("--formats", default="int8,int4,int4r", help="KV formats compared with the model dtype's")
    ap.add_argument("--block-size", type=int, default=16,
                    help="tokens a KV block of the quantized formats (INT4's keys share ranges per block)")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.target_top1 is None and args.text == "random":
        args.target_top1 = 0.5
    if args.seqs < 1 or args.tokens < 2 or not (args.target_top1 is None or 0 < args.target_top1 < 1):
        raise ValueError("need --seqs >= 1, --tokens >= 2 and 0 < --target-top1 < 1")
    from llmbus.model.loader import load_model

    if args.model_dir is None:
        from llmbus.model.demo import ensure_demo_model

        args.model_dir = ensure_demo_model(args.demo)
    loaded = load_model(args.model_dir, dtype="float32" if args.controls else args.dtype, device=args.device)
    model, cfg = loaded.model, loaded.config
    tokens = eval_tokens(args.text, Path(args.model_dir), cfg, args.seqs, args.tokens, args.seed)
    t0 = time.time()
    prompt = args.tokens // 2 if args.prompt_tokens is None else args.prompt_tokens
    run = functools.partial(run_logits, path=args.path, prompt_tokens=prompt)
    ref = run(model, cfg, "model", tokens, args.device)
    alpha = 1.0 if args.target_top1 is None else peaky_alpha(ref, args.target_top1)
    result = dict(model=str(args.model_dir), dtype=str(next(model.parameters()).dtype), seqs=args.seqs,
                  tokens=args.tokens, text=args.text, path=args.path, seed=args.seed, block_size=args.block_size,
                  alpha=alpha,
                  target_top1=args.target_top1,
                  raw_top1_prob=float(torch.softmax(ref, -1).amax(-1).mean()), formats={})
    rows = {fmt: run(model, cfg, fmt, tokens, args.device, args.block_size)
            for fmt in args.formats.split(",") if fmt}
    for group in (int(g) for g in args.candidate_key_groups.split(",") if g):
        backend = candidate_backend(args.device, group, args.candidate_value_group, args.candidate_rotate_values)
        name = f"candidate: int4, keys rotated, per token in groups of {group}"
        if args.candidate_value_group or args.candidate_rotate_values:
            name += (f"; values per token in groups of {args.candidate_value_group or 'int4'}"
                     f"{', rotated' if args.candidate_rotate_values else ''}")
        rows[name] = run(model, cfg, "model", tokens, args.device, backend=backend)
    if args.controls:
        rows["control: int4, no tail rows"] = run(model, cfg, "int4", tokens, args.device, args.block_size, tails=False)
        rows["control: bf16 KV"] = run(model, cfg, "model", tokens, args.device, kv_dtype="bfloat16")
        del model
        bf16 = load_model(args.model_dir, dtype="bfloat16", device=args.device).model
        rows["control: bf16 model"] = run(bf16, cfg, "model", tokens, args.device)
    scored = prompt if args.path == "mixed" else 0  # mixed: the decode steps after the prompt
    if scored:
        result["prompt_tokens"] = prompt
    for name, got in rows.items():
        result["formats"][name] = compare(ref[:, scored:], got[:, scored:], alpha)
    result["seconds"] = time.time() - t0
    # how often the reference predicts the text's next token (meaningful for real text only)
    result["ref_next_token_accuracy"] = float((ref[:, :-1].argmax(-1) == tokens[:, 1:]).float().mean())
    scaled = "unscaled" if args.target_top1 is None else f"x {alpha:.3g} for a mean top-1 prob of {args.target_top1}"
    print(f"model {args.model_dir} ({result['dtype']}), {args.seqs} x {args.tokens} {args.text} tokens "
          f"teacher-forced; logits {scaled} (unscaled mean top-1 prob {result['raw_top1_prob']:.3f}; "
          f"reference predicts the next token {100 * result['ref_next_token_accuracy']:.1f}% of the time)")
    print("| KV format | top-1 agreement | mean KL | max KL |\n|---|---:|---:|---:|")
    for fmt, r in result["formats"].items():
        print(f"| {fmt} | {100 * r['top1_agreement']:.2f}% | {r['mean_kl']:.2e} | {r['max_kl']:.2e} |")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
