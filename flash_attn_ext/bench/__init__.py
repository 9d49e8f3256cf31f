"""Benchmark: flash_attn_ext against SDPA's backends, standard attention and FlashAttention.

    python -m flash_attn_ext.benchmark                  # CPU: small sizes; CUDA: the ANCHORS sweep
    python -m flash_attn_ext.benchmark --quick          # a shorter sweep
    python -m flash_attn_ext.benchmark --help           # every flag
    (python -m flash_attn_ext.bench: the same command)

Each case is (dtype, headdim, causal, seqlen, GQA ratio, mode) with mode one of ``fwd``, ``bwd``
(the backward pass alone, given a saved forward graph) or ``fwd_bwd``. Inputs are BSHD
``(batch, seqlen, nheads, headdim)`` random normal tensors; batch = tokens // seqlen (16k tokens
by default) and nheads = 2048 // headdim on CUDA, as in the team's anchor measurements (README,
Benchmark). The compact table is the last thing printed on stdout; the progress bar goes to stderr.

Modules: peers (the implementations compared), timing (inputs, time, peak memory), accuracy
(errors against the float64 reference), report (tables, CSV/JSON, plots), cli (flags, sweep, main).
Each documents the columns it produces. Requires the ``bench`` extra (pandas, matplotlib, tqdm):
``pip install -e '.[bench]'``.
"""

from flash_attn_ext.bench.accuracy import measure_errors, reference_chunked
from flash_attn_ext.bench.cli import (DTYPE_NAMES, DTYPES, MODES, Sweep, main, make_parser,
                                      resolve_args, run_sweep)
from flash_attn_ext.bench.peers import (ALL_PEERS, OURS, SDPA_BACKENDS, BenchmarkError, Impl,
                                        build_impls, standard_attention)
from flash_attn_ext.bench.report import (CASE_KEYS, add_ratios, compact_table, environment, plot,
                                         summarize, to_markdown)
from flash_attn_ext.bench.timing import (DEFAULT_L2_BYTES, MAX_INPUT_SETS, Problem, Timer,
                                         input_sets_needed, measure, peak_extra_memory_mib,
                                         time_impl)

__all__ = [
    "ALL_PEERS", "CASE_KEYS", "DEFAULT_L2_BYTES", "DTYPES", "DTYPE_NAMES", "MAX_INPUT_SETS", "MODES",
    "OURS", "SDPA_BACKENDS", "BenchmarkError", "Impl", "Problem", "Sweep", "Timer", "add_ratios",
    "build_impls", "compact_table", "environment", "input_sets_needed", "main", "make_parser",
    "measure", "measure_errors", "peak_extra_memory_mib", "plot", "reference_chunked",
    "resolve_args", "run_sweep", "standard_attention", "summarize", "time_impl", "to_markdown",
]
