"""`llmbus demo-model`: write a demo model directory."""

from __future__ import annotations

import argparse


def _demo_model(args: argparse.Namespace) -> int:
    from llmbus.model.demo import default_demo_dir, make_demo_model

    if args.out is None and args.seed != 0:  # NOTE: the cache holds seed 0, which `llmbus up` serves
        raise ValueError("--seed other than 0 needs --out: the demo model cache holds seed 0's weights")
    out = args.out or default_demo_dir(args.size, args.tokenizer)
    path = make_demo_model(out, args.size, seed=args.seed, tokenizer=args.tokenizer)
    print(path)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("demo-model", help="write a deterministic random demo model (HF format)")
    p.add_argument("--size", choices=("small", "large"), default="small", help="small: ~1.3M params; large: ~100M")
    p.add_argument("--tokenizer", choices=("bpe", "sentencepiece"), default="bpe",
                   help="bpe: byte-level BPE (tokenizer.json); sentencepiece: SentencePiece BPE with byte "
                        "fallback (tokenizer.model + tokenizer.json), which llama.cpp can convert. Same weights.")
    p.add_argument("--out", default=None, help="output directory (default: the demo model cache dir)")
    p.add_argument("--seed", type=int, default=0, help="weights' seed (other than 0: with --out)")
    p.set_defaults(func=_demo_model)
