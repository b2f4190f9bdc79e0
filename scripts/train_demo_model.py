"""Train a demo model's architecture on real text, for measurements a random model cannot make.

A random model's next-token choice is a near-tie between many tokens and depends chaotically on
its whole context (docs/benchmarks.md, "KV quantization accuracy"), so how often a perturbation of
its KV cache flips the top token says little about the perturbation. This script trains the same
architecture (config and tokenizer copied from ``--base``) from a standard initialisation on the
Python standard library's source, which is on every machine with Python, and writes a Hugging
Face checkpoint our loader reads like any other. Held out: the files whose path's CRC-32 is 0
mod 20, so the split is the same whatever other files a Python version adds or drops. Left out
altogether: the test suites and ``encodings/`` (generated codec tables that are near-copies of
each other, which would leak held-out text into training).

bf16 autocast, AdamW; on a 2-vCPU AVX512-BF16 machine the large demo model trains at about
450 tokens/s (batch 8 x 256 tokens in ~4.5 s; 500 steps in ~38 min), on a GPU (``--device cuda``)
in about a minute. A CPU without bf16 instructions runs bf16 autocast far slower than fp32 (a
step took over four minutes on a 2-vCPU AVX2 machine): ``--fp32`` trains in fp32 there (~15 s a
step). The batches are drawn from a seeded generator, the same on any device. Uses
``transformers`` (a test-time dependency) for the training forward/backward only.

    python scripts/train_demo_model.py --base bench-results/models/large-sp --out DIR [--steps 500]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import platform
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmbus.bench.corpus import corpus_files, is_held_out, stdlib_root  # noqa: E402, F401 - the split, also the tests'
from llmbus.model.config import token_ids  # noqa: E402

_COPIED = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json")


def corpus_tokens(tokenizer_json: Path, held_out: bool, max_tokens: int, eos_id: int) -> torch.Tensor:
    """Token ids of the training (or held-out) files, each followed by ``eos_id``, up to ``max_tokens``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    ids: list[int] = []
    for path in corpus_files():
        if is_held_out(path) != held_out:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids += tok.encode(text, add_special_tokens=False).ids + [eos_id]
        if len(ids) >= max_tokens:
            break
    return torch.tensor(ids[:max_tokens], dtype=torch.long)


def windows(tokens: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(tokens) - seq + 1, (batch,), generator=gen)
    return torch.stack([tokens[s:s + seq] for s in starts.tolist()])


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def held_out_loss(model, tokens: torch.Tensor, seq: int, n: int = 16, autocast: bool = True) -> float:
    device = next(model.parameters()).device
    x = windows(tokens, n, seq, torch.Generator().manual_seed(1234)).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        return float(model(input_ids=x, labels=x).loss)


def save(model, base: Path, out: Path, info: dict) -> None:
    """A bf16 checkpoint in ``out``, written aside and renamed into place (a reader never sees a
    half-written one); the fp32 weights the optimizer steps stay as they are."""
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    state = {name: t.detach().to("cpu", torch.bfloat16) for name, t in model.state_dict().items()}
    model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
    for name in _COPIED:
        if (base / name).is_file():
            shutil.copyfile(base / name, tmp / name)
    cfg = json.loads((tmp / "config.json").read_text())
    cfg.pop("llmbus_demo_init", None)  # not the demo models' random conditioning
    cfg["dtype"] = "bfloat16"  # transformers writes the training (fp32) parameters' dtype
    cfg["llmbus_demo_trained"] = info
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True, help="demo model directory (config and tokenizer)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=4_000_000, help="training tokens read from the corpus")
    ap.add_argument("--held-out-tokens", type=int, default=200_000)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda where there is one (the same recipe, faster)")
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast (for CPUs without bf16 instructions)")
    args = ap.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    cfg = LlamaConfig.from_pretrained(args.base)
    cfg.initializer_range = 0.02  # the standard Llama initialisation, not the demo's random conditioning
    eos = (token_ids(cfg.eos_token_id, "eos_token_id") or (0,))[0]
    num_files = len(corpus_files())
    train = corpus_tokens(args.base / "tokenizer.json", False, args.max_tokens, eos)
    held = corpus_tokens(args.base / "tokenizer.json", True, args.held_out_tokens, eos)
    print(f"corpus: {len(train):,} training tokens, {len(held):,} held out", flush=True)
    model = LlamaForCausalLM(cfg).float().to(args.device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    t0, seen = time.time(), 0
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        x = windows(train, args.batch, args.seq, gen).to(args.device)
        with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=not args.fp32):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen += x.numel()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.3f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"{seen / (time.time() - t0):.0f} tok/s", flush=True)
        if (step + 1) % args.save_every == 0 or step == args.steps - 1:
            ho = held_out_loss(model, held, args.seq, autocast=not args.fp32)
            save(model, args.base, args.out, dict(corpus="python stdlib", python=platform.python_version(),
                                                  corpus_files=num_files, steps=step + 1, tokens=seen,
                                                  held_out_loss=round(ho, 4), seed=args.seed,
                                                  batch=args.batch, seq=args.seq, lr=args.lr,
                                                  autocast="none" if args.fp32 else "bf16"))
            print(f"saved step {step + 1}: held-out loss {ho:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
