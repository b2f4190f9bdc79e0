"""Engine configuration: one frozen dataclass, validated at construction."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from llmbus.kv.formats import KV_FORMATS  # the engine's --kv-format choices


@dataclass(frozen=True)
class EngineConfig:
    dtype: str | None = None  # None: the checkpoint's dtype (fp32 on CPU if it is fp16/bf16 and fp32 is asked)
    device: str | None = None  # None: cuda if available, else cpu
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from kv_cache_bytes
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    kv_format: str = "model"
    num_threads: int | None = None  # torch CPU threads; None leaves torch's default
    cpu_micro_batches: int = 1  # > 1: split each CPU step into this many single-threaded micro-batches
    pack_cpu_weights: bool = True  # CPU: projection weights reordered once, ours or oneDNN's (llmbus.model.cpu_linear)
    # decode-only steps replay recorded CUDA graphs (llmbus.engine.graphs); None: wherever that
    # applies (CUDA, the Triton backend, no dynamic rope), False: never, True: warn where it cannot
    cuda_graphs: bool | None = None
    # dummy steps at start so first requests do not wait for kernels to compile, nor for a full
    # step's fresh memory (Engine.warmup); None: on CUDA (the services' workers: everywhere)
    warmup: bool | None = None
    # speculative decoding by n-gram lookup (llmbus.engine.speculative): up to this many tokens
    # drafted from earlier text per decode, all checked in the same step; 0: off
    speculative_tokens: int = 0
    speculative_ngram: tuple[int, int] = (2, 4)  # (shortest, longest) suffix looked up
    # a step's decode rows (one a sequence, one a drafted token) stay within this many; None: four
    # row groups, 32 on CPU, 64 with AMX, 256 on CUDA (past the rows that fill the step's last
    # group, only trusted drafts go)
    speculative_max_rows: int | None = None

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64):
            raise ValueError(f"block_size must be 8, 16, 32 or 64, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if self.cpu_micro_batches < 1:
            raise ValueError(f"cpu_micro_batches must be >= 1, got {self.cpu_micro_batches}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {', '.join(KV_FORMATS)}, got {self.kv_format!r}")
        if self.dtype not in (None, "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if not 0 <= self.speculative_tokens <= 16:
            raise ValueError(f"speculative_tokens must be between 0 and 16, got {self.speculative_tokens}")
        lo, hi = self.speculative_ngram
        if not 1 <= lo <= hi <= 16:
            raise ValueError(f"speculative_ngram must be MIN:MAX with 1 <= MIN <= MAX <= 16, got {lo}:{hi}")
        if self.speculative_max_rows is not None and self.speculative_max_rows < 2:
            raise ValueError(f"speculative_max_rows must be >= 2, got {self.speculative_max_rows}")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The ``EngineConfig`` options, shared by `llmbus generate` and the prefill/decode workers."""
    parser.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--kv-format", default="model", choices=KV_FORMATS)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks in this worker's cache")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--long-prefill-threshold", type=int, default=0,
                        help="cap on one prefill chunk (0: the whole step budget)")
    parser.add_argument("--no-prefix-cache", action="store_true")
    parser.add_argument("--no-chunked-prefill", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads for this worker")
    parser.add_argument("--cpu-micro-batches", type=int, default=1,
                        help="split each CPU step into N single-threaded micro-batches on N threads "
                             "(faster than intra-op threads for attention-heavy fp32 models)")
    graphs = parser.add_mutually_exclusive_group()
    graphs.add_argument("--cuda-graphs", dest="cuda_graphs", action="store_const", const=True, default=None,
                        help="record decode steps of up to --max-num-seqs sequences as CUDA graphs and replay "
                             "them (one launch a step instead of hundreds; the default on CUDA)")
    graphs.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_const", const=False,
                        help="CUDA: run every decode step eagerly")
    parser.add_argument("--no-warmup", dest="warmup", action="store_const", const=False, default=None,
                        help="skip the dummy steps at start that compile the kernels (CUDA) and allocate a full step's "
                             "memory before the first request")
    parser.add_argument("--no-packed-weights", action="store_true",
                        help="CPU: keep plain weights instead of packed ones (slower; for comparison)")
    parser.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                        help="speculative decoding: draft up to K tokens per decode by looking up the text's last "
                             "n-gram earlier in it, and check them in the same step (0: off; not with int4 KV)")
    parser.add_argument("--speculative-ngram", type=_ngram, default=(2, 4), metavar="MIN:MAX",
                        help="n-gram lengths the drafts are looked up by, longest first (default 2:4)")
    parser.add_argument("--speculative-max-rows", type=int, default=None, metavar="N",
                        help="a step's decode rows (one per sequence, one per drafted token) stay within N; the "
                             "rows that fill the step's last group of 8 (16 with AMX, 64 on CUDA), which cost little, are "
                             "shared among the decodes, the rest go to sequences whose drafts are mostly "
                             "confirmed (default: four groups, 32 on CPU, 64 with AMX, 256 on CUDA)")


def _ngram(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        return (int(lo), int(hi)) if sep else (int(lo), int(lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX (two integers), got {text!r}") from None


# the command-line option of each EngineConfig field whose name differs from it, for error messages
_OPTION_OF = {"num_threads": "--threads", "long_prefill_token_threshold": "--long-prefill-threshold"}


def option_error(exc: ValueError, args: argparse.Namespace) -> ValueError:
    """``exc`` ("<field> must be ...") naming the command-line option instead of the field, where
    ``args`` has that option; otherwise ``exc`` as it is."""
    field, _, rest = str(exc).partition(" ")
    option = _OPTION_OF.get(field, "--" + field.replace("_", "-"))
    if not rest or not hasattr(args, option[2:].replace("-", "_")):  # kv_cache_bytes, for one, has no option
        return exc
    return ValueError(f"{option} {rest}")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the options ask for; a ValueError names the option, not the field."""
    try:
        return _engine_config(args)
    except ValueError as exc:
        raise option_error(exc, args) from None


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        long_prefill_token_threshold=args.long_prefill_threshold,
        enable_prefix_caching=not args.no_prefix_cache,
        enable_chunked_prefill=not args.no_chunked_prefill,
        kv_format=args.kv_format,
        num_threads=args.threads,
        cpu_micro_batches=args.cpu_micro_batches,
        pack_cpu_weights=not args.no_packed_weights,
        cuda_graphs=args.cuda_graphs,
        warmup=args.warmup,
        speculative_tokens=args.speculative_tokens,
        speculative_ngram=args.speculative_ngram,
        speculative_max_rows=args.speculative_max_rows,
    )
