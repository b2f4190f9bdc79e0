"""`llmbus generate`: run the in-process engine on one or more prompts."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import orjson

from llmbus.engine.config import add_engine_args, engine_config_from_args, option_error


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with the in-process engine")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt text (repeatable); - reads one prompt from standard input")
    src.add_argument("--prompt-ids", action="append", help="comma-separated token ids (repeatable)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None)
    guide = p.add_mutually_exclusive_group()
    guide.add_argument("--json-schema", metavar="SCHEMA", help="output JSON matching this JSON Schema (inline JSON, or @FILE)")
    guide.add_argument("--json-object", action="store_true", help="output a JSON object")
    add_engine_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=run)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",")]  # ("1,,2": an error, not [1, 2])
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _prompts(texts: list[str]) -> list[str]:
    if texts.count("-") > 1:
        raise ValueError("--prompt - (standard input) can be given once")
    return [sys.stdin.read() if t == "-" else t for t in texts]


def _guide(args: argparse.Namespace) -> str:
    """The guide spec of --json-schema / --json-object ("" for free text)."""
    from llmbus.guide.grammar import GuideError, check_guide, guide_spec

    if args.json_object:
        return guide_spec()
    if args.json_schema is None:
        return ""
    text = args.json_schema
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"--json-schema {args.json_schema}: {exc.strerror}") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--json-schema must be a JSON Schema (inline or @FILE): {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError("--json-schema must be a JSON object (a JSON Schema)")
    spec = guide_spec(schema)
    try:
        check_guide(spec)
    except GuideError as exc:
        raise ValueError(f"--json-schema: {exc}") from None
    return spec


def run(args: argparse.Namespace) -> int:
    from llmbus.engine.llm import LLM
    from llmbus.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
            logprobs=args.logprobs,
            guide=_guide(args),
        )
    except ValueError as exc:
        raise option_error(exc, args) from None
    prompts = _prompts(args.prompt) if args.prompt else [_parse_ids(t) for t in args.prompt_ids]
    llm = LLM(args.model, **dataclasses.asdict(engine_config_from_args(args)))
    failed = False
    for i, out in enumerate(llm.generate(prompts, params), 1):
        if args.json:
            record = {"token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason}
            if out.error:
                record["error"] = out.error
            if out.logprobs is not None:
                record["logprobs"] = [
                    {"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top} for lp in out.logprobs
                ]
            sys.stdout.write(orjson.dumps(record).decode() + "\n")
        elif llm.tokenizer is None:  # no tokenizer.json: no text to show, so the token ids
            sys.stdout.write(",".join(map(str, out.token_ids)) + "\n")
        else:
            sys.stdout.write(out.text + "\n")
        if out.error:
            failed = True
            print(f"llmbus generate: prompt {i}: {out.error}", file=sys.stderr)
    sys.stdout.flush()
    return 1 if failed else 0
