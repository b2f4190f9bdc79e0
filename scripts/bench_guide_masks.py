"""Guided decoding's cost per token on the engine thread: ``GuideMasks.mask`` timed at every token
of one output, for patterns with long counted repetitions and, for comparison, a plain bounded
string. Each case starts from empty caches (a worker's first request with the guide); the
output is the case's text cut greedily into the longest tokens of the vocabulary.

    python scripts/bench_guide_masks.py [--model bench-results/models/large-sp] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from llmbus.guide.grammar import compile_guide, guide_spec  # noqa: E402
from llmbus.guide.masks import GuideMasks, GuideRun, TokenIndex  # noqa: E402
from llmbus.model.tokenizer import Tokenizer  # noqa: E402

PROSE = ("The quick brown fox jumps over the lazy dog; caf\u00e9 cr\u00e8me, na\u00efve \u00fcber "
         "\u4e2d\u6587 text, 42 numbers & symbols (ok?) \U0001f600 and more words to fill the line. ") * 3
WORDS = "thequickbrownfoxjumpsoverthelazydogandkeepsrunningacrossthefield" * 4
CASES = [  # (name, guide spec, the output's text)
    ("regex ^.{0,256}$", guide_spec(regex="^.{0,256}$"), PROSE[:250]),
    ("regex ^[a-z]{1,200}$", guide_spec(regex="^[a-z]{1,200}$"), WORDS[:190]),
    ("regex ^\\d{3}-.{0,128}$", guide_spec(regex="^\\d{3}-.{0,128}$"), "123-" + PROSE[:120]),
    ("regex ^\\d{0,64}$", guide_spec(regex="^\\d{0,64}$"), "31415926535897932384626433832795028841971693993751058209749445"),
    ("schema pattern ^.{0,256}$", guide_spec({"type": "string", "pattern": "^.{0,256}$"}), json.dumps(PROSE[:250])),
    ("schema maxLength 256", guide_spec({"type": "string", "maxLength": 256}), json.dumps(PROSE[:250])),
]


def greedy_tokens(index: TokenIndex, data: bytes) -> list[int]:
    """``data`` as the longest vocabulary tokens, left to right (every byte has a token)."""
    by_piece = {p: i for i, p in enumerate(index.pieces) if p}
    longest = max(map(len, by_piece))
    out, at = [], 0
    while at < len(data):
        n = next(n for n in range(min(longest, len(data) - at), 0, -1) if data[at : at + n] in by_piece)
        out.append(by_piece[data[at : at + n]])
        at += n
    return out


def time_case(index: TokenIndex, spec: str, tokens: list[int]) -> list[float]:
    """Seconds of ``mask`` at each token of the output, from empty caches (masks, the grammar's
    steps, the vocabulary's tables), as a worker's first request with ``spec`` meets them."""
    compile_guide.cache_clear()
    index = TokenIndex(index.pieces)
    masks, run, cpu, took = GuideMasks(index), GuideRun(spec), torch.device("cpu"), []
    for n in range(len(tokens) + 1):
        masks.advance(run, tokens[:n], set())
        assert run.state is not None, "the case's text does not match its guide"
        start = time.perf_counter()
        ids, _ = masks.mask(run, cpu)
        took.append(time.perf_counter() - start)
        assert n == len(tokens) or tokens[n] in set(ids.tolist()), "the mask refuses the case's own next token"
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-results/models/large-sp")
    parser.add_argument("--repeat", type=int, default=3, help="runs per case; the best mean is reported")
    args = parser.parse_args()
    index = TokenIndex.from_tokenizer(Tokenizer.from_dir(args.model))
    print(f"{args.model}: {sum(p is not None for p in index.pieces)} tokens")
    print(f"{'case':28} {'tokens':>6} {'mean ms':>8} {'median':>8} {'max':>8}  (per token, from empty caches)")
    for name, spec, text in CASES:
        tokens = greedy_tokens(index, text.encode("utf-8"))
        runs = [time_case(index, spec, tokens) for _ in range(args.repeat)]
        best = min(runs, key=statistics.fmean)
        ms = [t * 1000 for t in best]
        print(f"{name:28} {len(tokens):6} {statistics.fmean(ms):8.3f} {statistics.median(ms):8.3f} {max(ms):8.3f}")


if __name__ == "__main__":
    main()
