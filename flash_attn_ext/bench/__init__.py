"""Benchmark: flash_attn_ext against SDPA's backends, standard attention and FlashAttention.

    python -m flash_attn_ext.benchmark                  # CPU: small sizes; CUDA: the anchor sweep
    python -m flash_attn_ext.benchmark --quick          # a shorter sweep
    python -m flash_attn_ext.benchmark --help           # every flag
    (python -m flash_attn_ext.bench: the same command)

Each case is (dtype, headdim, causal, seqlen, GQA ratio, mode) with mode one of ``fwd``, ``bwd``
(the backward pass alone, given a saved forward graph) or ``fwd_bwd``; two more families of
modes: ``decode`` (one query token against a KV cache, contiguous or paged, full or filled to
--decode-fill: TB/s of the K+V read; --decode-cases, --page-size) and ``varlen_fwd`` /
``varlen_bwd`` (packed sequences of mixed lengths: TFLOP/s on the real work, beside the dense op
on as many tokens; --varlen-*).
Inputs are BSHD ``(batch, seqlen, nheads, headdim)`` random normal tensors; batch = tokens //
seqlen (16k tokens by default) and nheads = 2048 // headdim on CUDA, as in the team's anchor
measurements (README, Benchmark). The dense compact table is the last thing printed on stdout
(the decode and varlen tables come before it); the progress bar goes to stderr.

Modules: peers (the implementations compared), problems (each case's inputs and the work it
counts), timing (time, peak memory), accuracy (errors against the float64 reference), sweeps (the
loops over cases), report (tables, CSV/JSON, plots), cli (flags, main).
Each documents the columns it produces. Requires the ``bench`` extra (pandas, matplotlib, tqdm):
``pip install --no-build-isolation -e '.[bench]'``.
"""

from flash_attn_ext.bench.accuracy import measure_errors, reference_chunked
from flash_attn_ext.bench.cli import DTYPES, main, make_parser, resolve_args
from flash_attn_ext.bench.peers import (ALL_PEERS, OURS, OURS_DENSE, SDPA_BACKENDS, BenchmarkError,
                                        Impl, NotApplicable, build_impls, standard_attention)
from flash_attn_ext.bench.problems import (MAX_INPUT_SETS, DecodeProblem, Problem, VarlenProblem,
                                           decode_kv_bytes, decode_lengths, input_sets_needed,
                                           mixed_lengths, sets_for_bytes, varlen_flops)
from flash_attn_ext.bench.report import (CASE_KEYS, DECODE_KEYS, VARLEN_KEYS, add_ratios,
                                         compact_table, decode_table, environment, plot, summarize,
                                         to_markdown, varlen_table)
from flash_attn_ext.bench.sweeps import (DTYPE_NAMES, MODES, Sweep, run_decode, run_sweep,
                                         run_varlen)
from flash_attn_ext.bench.timing import (DEFAULT_L2_BYTES, Timer, measure, measure_group,
                                         measure_interleaved, peak_extra_memory_mib, time_impl)

__all__ = [
    "ALL_PEERS", "CASE_KEYS", "DECODE_KEYS", "DEFAULT_L2_BYTES", "DTYPES", "DTYPE_NAMES",
    "MAX_INPUT_SETS", "MODES", "OURS", "OURS_DENSE", "SDPA_BACKENDS", "VARLEN_KEYS",
    "BenchmarkError", "DecodeProblem", "Impl", "NotApplicable", "Problem", "Sweep", "Timer",
    "VarlenProblem", "add_ratios", "build_impls", "compact_table", "decode_kv_bytes",
    "decode_lengths", "decode_table", "environment", "input_sets_needed", "main", "make_parser",
    "measure", "measure_errors", "measure_group", "measure_interleaved", "mixed_lengths",
    "peak_extra_memory_mib", "plot", "reference_chunked", "resolve_args", "run_decode", "run_sweep",
    "run_varlen", "sets_for_bytes", "standard_attention", "summarize", "time_impl", "to_markdown",
    "varlen_flops", "varlen_table",
]
