"""Command line: flags, and main (``python -m flash_attn_ext.benchmark``).

Modes fwd, bwd, fwd_bwd run the dense sweep; decode the KV-cache cases (--decode-cases x
--page-size); varlen_fwd, varlen_bwd the packed mixed-length batch (--varlen-*); the loops are
in flash_attn_ext.bench.sweeps. Any mix of them runs in one call (dense, then decode, then
varlen); a family whose flash_attn_ext entry this build lacks is skipped with a note; SIGTERM
(``timeout``) or Ctrl-C writes the rows measured so far.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
import threading
import time

import torch

from flash_attn_ext.bench import report
from flash_attn_ext.bench.peers import (ALL_PEERS, OURS, OURS_DENSE, BenchmarkError, build_impls,
                                        ours_dense_impl)
from flash_attn_ext.bench.sweeps import (MODES, Sweep, run_decode, run_sweep, run_varlen,
                                         varlen_dense_shape)
from flash_attn_ext.bench.timing import Timer

DECODE_CASES = "B1xN8192,B1xN131072,B8xN32768,B64xN8192,B64xN32768"  # issue 14's decode cases
DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32,
    "fp64": torch.float64, "float64": torch.float64,
}


def _int_list(flag: str, text: str, unique: bool = True) -> list[int]:
    """Positive integers; with ``unique`` a value given twice is measured once (the tables key
    their rows by these values)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchmarkError(f"{flag}: expected a comma-separated list of integers, got {text!r}")
    if not values or any(x <= 0 for x in values):
        raise BenchmarkError(f"{flag}: expected positive integers, got {text!r}")
    return list(dict.fromkeys(values)) if unique else values


def _choice_list(flag: str, text: str, choices) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in values if x not in choices]
    if not values or bad:
        raise BenchmarkError(f"{flag}: expected a comma-separated list from {sorted(set(choices))}, "
                             f"got {text!r}")
    return list(dict.fromkeys(values))  # a name given twice is measured once


def _causal_list(text: str) -> list[bool]:
    table = {"both": [False, True], "true": [True], "1": [True], "false": [False], "0": [False]}
    out = []
    for x in text.lower().split(","):
        if x.strip() not in table:
            raise BenchmarkError(f"--causal: expected both, true, false (or 1, 0), got {text!r}")
        out += [c for c in table[x.strip()] if c not in out]
    return out


def _decode_cases(text: str) -> list[tuple[int, int]]:
    """``B1xN8192,B64xN32k`` -> [(1, 8192), (64, 32768)] (a k suffix multiplies by 1024)."""
    cases = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*B(\d+)xN(\d+)(k?)\s*", item, re.IGNORECASE)
        if not m or int(m[1]) <= 0 or int(m[2]) <= 0:
            raise BenchmarkError(f"--decode-cases: expected a comma-separated list of "
                                 f"B<batch>xN<seqlen_k> (e.g. B1xN8192,B64xN32k), got {text!r}")
        cases.append((int(m[1]), int(m[2]) * (1024 if m[3] else 1)))
    return list(dict.fromkeys(cases))  # B1xN1k and B1xN1024: one case


def _page_sizes(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(x < 0 or x % 16 for x in values):
        raise BenchmarkError(f"--page-size: expected a comma-separated list of 0 (contiguous cache) "
                             f"or page sizes that are multiples of 16 (the paged kernels'), got {text!r}")
    return list(dict.fromkeys(values))  # each once


def _heads_pair(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+):(\d+)\s*", text)
    if not m or int(m[1]) <= 0 or int(m[2]) <= 0 or int(m[1]) % int(m[2]):
        raise BenchmarkError(f"--decode-heads: expected NHEADS:NHEADS_K with NHEADS a multiple "
                             f"of NHEADS_K (e.g. 32:8), got {text!r}")
    return int(m[1]), int(m[2])


def _check_positive(flag: str, value, kind: str = "integer") -> None:
    """BenchmarkError naming ``flag`` unless ``value`` is None or finite and > 0."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise BenchmarkError(f"{flag}: expected a positive finite {kind}, got {value}")


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: ...)" only where there is one: a None default is device-dependent, and its
    help text says what it becomes."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m flash_attn_ext.benchmark",
        description="Benchmark flash_attn_ext against SDPA backends, standard attention and "
                    "FlashAttention (if installed). Defaults depend on the device: on CUDA the "
                    "anchor sweep (bf16, hdim 64,128, causal both, seqlen 512..16384, 16k tokens, "
                    "nheads 2048/hdim, fwd and bwd); on CPU small sizes (fp32, hdim 64, seqlen "
                    "128..512, batch 2, 4 heads).",
        formatter_class=_DefaultsFormatter)
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cuda:N or cpu")
    ap.add_argument("--dtype", default=None, help="comma list of bf16, fp16, fp32, fp64 "
                    "[cuda: bf16; cpu: fp32]")
    ap.add_argument("--hdim", default=None, help="comma list of head dims [cuda: 64,128; cpu: 64]")
    ap.add_argument("--causal", default="both", help="both, true or false")
    ap.add_argument("--seqlen", default=None,
                    help="comma list [cuda: 512,1024,2048,4096,8192,16384; cpu: 128,256,512]")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens per batch: batch = max(1, tokens // seqlen) [cuda: 16384]")
    ap.add_argument("--batch", type=int, default=None,
                    help="fixed batch size, overrides --tokens [cpu: 2]")
    ap.add_argument("--nheads", type=int, default=None,
                    help="query heads [cuda: 2048 // hdim; cpu: 4]")
    ap.add_argument("--gqa", default="1", help="comma list of GQA ratios nheads / nheads_k")
    ap.add_argument("--mode", default="fwd,bwd",
                    help="comma list of fwd, bwd, fwd_bwd (dense), decode (KV cache, "
                         "--decode-*), varlen_fwd, varlen_bwd (packed sequences, --varlen-*)")
    ap.add_argument("--peers", default=",".join(ALL_PEERS),
                    help="comma list of peers to compare against (or 'none')")
    dec = ap.add_argument_group("decode (--mode decode): one query token per sequence against a "
                                "KV cache (full, or filled to --decode-fill); GQA heads from "
                                "--decode-heads, dtype from --dtype")
    dec.add_argument("--decode-cases", default=None,
                     help=f"comma list of B<batch>xN<seqlen_k> [cuda: {DECODE_CASES}; --quick: "
                          "B1xN131072,B64xN32768; cpu: B1xN256,B2xN1024]")
    dec.add_argument("--page-size", default=None,
                     help="comma list of paged-KV page sizes (multiples of 16), 0 = contiguous cache "
                          "[cuda: 0,16,64,256; --quick: 0,64; cpu: 0,16]")
    dec.add_argument("--decode-heads", default=None, help="NHEADS:NHEADS_K [cuda: 32:8; cpu: 8:2]")
    dec.add_argument("--decode-hdim", default=None, help="comma list of head dims [cuda: 128; cpu: 64]")
    dec.add_argument("--decode-fill", type=float, default=1.0,
                     help="F in (0, 1]: the mean fraction of the cache each batch uses. Sequence "
                          "lengths (cache_seqlens) spread evenly over [F*Nk - w, F*Nk + w], "
                          "w = min(F, 1 - F)*Nk, at least 1, in a seeded order (1: every sequence "
                          "uses all Nk keys; batch 1: F*Nk); TB/s counts the K+V bytes of the used "
                          "lengths; rows carry fill F")
    dec.add_argument("--decode-graph", action="store_true",
                     help="time every implementation's decode step as the replay of a CUDA graph "
                          "(captured per input set, L2 flushed before each replay), as serving "
                          "engines run it: the GPU's time without the host's cost of issuing the "
                          "call (a ~20 us step is host-bound on a slow host); cuda only")
    var = ap.add_argument_group("varlen (--mode varlen_fwd,varlen_bwd): packed sequences of seeded "
                                "mixed lengths; dtype, hdim, causal, heads and gqa as the dense sweep")
    var.add_argument("--varlen-seqs", type=int, default=None, help="sequences [cuda: 64; cpu: 4]")
    var.add_argument("--varlen-tokens", type=int, default=None,
                     help="tokens, the sum of the lengths [cuda: 16384; cpu: 512]")
    var.add_argument("--varlen-lens", default=None,
                     help="MIN,MAX sequence length [cuda: 128,1024; cpu: 64,256]")
    var.add_argument("--varlen-dense-seqlen", type=int, default=None,
                     help="the comparison row ours-dense: flash_attn_func at batch "
                          "varlen-tokens // this x this seqlen, same heads [cuda: 1024; cpu: 256]")
    ap.add_argument("--out", default="bench_out", help="output directory")
    ap.add_argument("--quick", action="store_true",
                    help="short sweep (cuda: hdim 128, seqlen 1024,4096; cpu: seqlen 128,256) "
                         "with shorter timing")
    ap.add_argument("--warmup-ms", type=float, default=None, help="warm-up time per measurement "
                    "[25; --quick 10]")
    ap.add_argument("--rep-ms", type=float, default=None, help="time spent in timed repetitions "
                    "per measurement [cuda: 100, cpu: 60; --quick 30]")
    ap.add_argument("--rounds", type=int, default=1,
                    help="timed measurements of each (case, implementation), interleaved across the "
                         "implementations in a rotating order; the median-time one is reported (for an "
                         "even count the faster middle one; results.csv ms_spread: max / min over the "
                         "rounds; a failed round's status wins) [1]")
    ap.add_argument("--slow-max-seqlen", type=int, default=4096,
                    help="sdpa-math is skipped above this seqlen (decode: seqlen_k; it materializes "
                         "the scores and GQA's repeated K/V: seconds per dense call)")
    ap.add_argument("--ref-max-seqlen", type=int, default=16384,
                    help="errors vs the float64 reference are computed up to this seqlen (dense and "
                         "varlen; decode's, on a slice of at most 2 sequences, always)")
    ap.add_argument("--err-kv-heads", type=int, default=2,
                    help="KV heads (the first N - 1 and the last, with their query heads) of the "
                         "slice of the timed call the errors are measured on, with its first and "
                         "last batch items (decode: sequences; varlen: all), or of the reduced "
                         "problem of that shape where the call does not fit")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU: torch.set_num_threads (fewer threads than busy cores gives steadier "
                         "times on a shared machine) [torch's default]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--no-plots", action="store_true", help="do not write the PNG plots")
    return ap


def _device(text: str) -> torch.device:
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bad = BenchmarkError(f"--device: expected auto, cpu, cuda or cuda:N, got {text!r}")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise bad
    if device.type not in ("cpu", "cuda"):
        raise bad
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BenchmarkError("--device cuda: no CUDA device is available")
    return device


def resolve_args(args: argparse.Namespace) -> Sweep:
    """Fill device-dependent defaults and check every flag (BenchmarkError names the flag)."""
    device = _device(args.device)
    cuda = device.type == "cuda"
    dtypes = list(dict.fromkeys(DTYPES[x] for x in _choice_list("--dtype", args.dtype or ("bf16" if cuda else "fp32"),
                                                                DTYPES)))  # fp32,float32: once
    if cuda and any(d in (torch.float32, torch.float64) for d in dtypes):
        raise BenchmarkError("--dtype: flash_attn_ext on CUDA supports bf16 and fp16 only")
    if args.quick:
        hdims_default, seqlens_default = ("128", "1024,4096") if cuda else ("64", "128,256")
    else:
        hdims_default, seqlens_default = ("64,128", "512,1024,2048,4096,8192,16384") if cuda \
            else ("64", "128,256,512")
    hdims = _int_list("--hdim", args.hdim or hdims_default)
    bad = [h for h in hdims if h % 8 or h > 256]
    if bad:
        raise BenchmarkError(f"--hdim: expected multiples of 8 up to 256, got {bad}")
    seqlens = _int_list("--seqlen", args.seqlen or seqlens_default)
    gqas = _int_list("--gqa", args.gqa)
    modes = _choice_list("--mode", args.mode, MODES)
    peers = [] if args.peers.strip().lower() == "none" else _choice_list("--peers", args.peers, ALL_PEERS)
    tokens, batch = args.tokens, args.batch
    _check_positive("--tokens", tokens)
    _check_positive("--batch", batch)
    if tokens is None and batch is None:
        tokens, batch = (16384, None) if cuda else (None, 2)
    nheads = args.nheads
    _check_positive("--nheads", nheads)
    if nheads is None and not cuda:
        nheads = 4
    for h in hdims if any(report.family(m) != "decode" for m in modes) else ():  # decode: --decode-heads
        nh = nheads if nheads is not None else max(1, 2048 // h)
        for r in gqas:
            if nh % r:
                raise BenchmarkError(f"--gqa: ratio {r} does not divide nheads={nh} (hdim {h})")
    _check_positive("--warmup-ms", args.warmup_ms, "number")
    _check_positive("--rep-ms", args.rep_ms, "number")
    _check_positive("--rounds", args.rounds)
    _check_positive("--threads", args.threads)
    _check_positive("--err-kv-heads", args.err_kv_heads)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise BenchmarkError(f"--out: {args.out!r} exists and is not a directory")
    sweep = Sweep(device, dtypes, hdims, _causal_list(args.causal), seqlens, gqas, modes, peers,
                  tokens, batch, nheads)
    _resolve_decode(args, sweep, cuda)
    _resolve_varlen(args, sweep, cuda)
    return sweep


def _resolve_decode(args, sweep: Sweep, cuda: bool) -> None:
    quick = "B1xN131072,B64xN32768" if args.quick else DECODE_CASES
    sweep.decode_cases = _decode_cases(args.decode_cases or (quick if cuda else "B1xN256,B2xN1024"))
    pages = ("0,64" if args.quick else "0,16,64,256") if cuda else "0,16"
    sweep.page_sizes = _page_sizes(args.page_size or pages)
    sweep.decode_heads = _heads_pair(args.decode_heads or ("32:8" if cuda else "8:2"))
    sweep.decode_hdims = _int_list("--decode-hdim", args.decode_hdim or ("128" if cuda else "64"))
    bad = [h for h in sweep.decode_hdims if h % 8 or h > 256]
    if bad:
        raise BenchmarkError(f"--decode-hdim: expected multiples of 8 up to 256, got {bad}")
    if not 0.0 < args.decode_fill <= 1.0:
        raise BenchmarkError(f"--decode-fill: expected a fraction in (0, 1], got {args.decode_fill}")
    sweep.decode_fill = args.decode_fill
    if args.decode_graph and not cuda:
        raise BenchmarkError("--decode-graph: CUDA graphs need a CUDA device (this run is on the CPU)")
    sweep.decode_graph = args.decode_graph


def _resolve_varlen(args, sweep: Sweep, cuda: bool) -> None:
    for flag, value in (("--varlen-seqs", args.varlen_seqs), ("--varlen-tokens", args.varlen_tokens),
                        ("--varlen-dense-seqlen", args.varlen_dense_seqlen)):
        _check_positive(flag, value)
    seqs = args.varlen_seqs or (64 if cuda else 4)
    tokens = args.varlen_tokens or (16384 if cuda else 512)
    lens = _int_list("--varlen-lens", args.varlen_lens or ("128,1024" if cuda else "64,256"), unique=False)
    if len(lens) != 2 or lens[0] > lens[1]:
        raise BenchmarkError(f"--varlen-lens: expected MIN,MAX with MIN <= MAX, got {args.varlen_lens!r}")
    if not seqs * lens[0] <= tokens <= seqs * lens[1]:
        raise BenchmarkError(f"--varlen-tokens: {tokens} tokens do not fit {seqs} sequences of "
                             f"{lens[0]}..{lens[1]} (--varlen-seqs, --varlen-lens)")
    sweep.varlen_seqs, sweep.varlen_tokens, sweep.varlen_lens = seqs, tokens, tuple(lens)
    sweep.varlen_dense_seqlen = args.varlen_dense_seqlen or (1024 if cuda else 256)
    if sweep.varlen_dense_seqlen > tokens:
        raise BenchmarkError(f"--varlen-dense-seqlen: {sweep.varlen_dense_seqlen} is longer than the varlen batch's "
                             f"{tokens} tokens (--varlen-tokens); the ours-dense row runs as many tokens as it")


# The flags that shape one family's cases alone (their dest names), and the family.
FAMILY_FLAGS = {
    "dense": ("seqlen", "tokens", "batch"),
    "decode": ("decode_cases", "page_size", "decode_heads", "decode_hdim", "decode_fill", "decode_graph"),
    "varlen": ("varlen_seqs", "varlen_tokens", "varlen_lens", "varlen_dense_seqlen"),
}


def unused_flag_notes(args: argparse.Namespace, sweep: Sweep) -> list[str]:
    """A note for each flag given (not at its default) whose family no requested mode runs, so
    that `--mode fwd --decode-cases ...` says the cases were not run instead of ignoring them."""
    defaults = make_parser().parse_args([])
    notes = []
    for fam, dests in FAMILY_FLAGS.items():
        if sweep.modes_of(fam):
            continue
        given = ["--" + d.replace("_", "-") for d in dests if getattr(args, d) != getattr(defaults, d)]
        if given:
            notes.append(f"{', '.join(given)} ignored: no {fam} mode in --mode")
    return notes


class Interrupted(BaseException):
    """SIGTERM (e.g. from ``timeout``) during the sweep: the rows so far are still written. A
    BaseException, like KeyboardInterrupt, so that no ``except Exception`` (run_guarded turning
    a failing implementation into a status) swallows it."""


def _raise_interrupted(signum, frame):
    raise Interrupted()


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2: bad flag or environment, 1: flash_attn_ext
    failed on some case, 3: interrupted by SIGTERM or Ctrl-C, after writing the tables of the
    cases measured so far, 0 otherwise). Order: dense sweep, decode, varlen."""
    args = make_parser().parse_args(argv)
    impls, notes, dense = {}, [], None
    try:
        report.require_deps()
        sweep = resolve_args(args)
        for fam in ("dense", "decode", "varlen"):
            if sweep.modes_of(fam):
                impls[fam], fam_notes = build_impls(sweep.peers, sweep.device,
                                                    args.slow_max_seqlen, family=fam)
                notes += fam_notes
        if impls.get("varlen"):
            dense = ours_dense_impl()
        notes += unused_flag_notes(args, sweep)
        notes = list(dict.fromkeys(notes))  # a peer missing for several families: one note
    except BenchmarkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    cuda = sweep.device.type == "cuda"
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if cuda:
        torch.cuda.set_device(sweep.device.index or 0)  # do_bench synchronizes the current device
    warmup = args.warmup_ms if args.warmup_ms is not None else (10 if args.quick else 25)
    rep = args.rep_ms if args.rep_ms is not None else (30 if args.quick else (100 if cuda else 60))
    timer = Timer(sweep.device, warmup, rep, min_reps=3 if cuda else 5)
    env = report.environment(sweep.device, timer, sys.argv[1:] if argv is None else list(argv))
    if args.rounds > 1:
        env["timer"] += f"; median of {args.rounds} interleaved rounds per (case, implementation)"
    if impls.get("decode"):
        env["decode_fill"] = sweep.decode_fill
    if impls.get("varlen"):
        env["varlen_dense"] = "batch {} x seqlen {}".format(*varlen_dense_shape(sweep))

    base = len(sweep.dtypes) * len(sweep.hdims) * len(sweep.causals) * len(sweep.gqas)
    n_runs = (base * len(sweep.seqlens) * len(sweep.modes_of("dense")) * len(impls.get("dense", []))
              + len(sweep.dtypes) * len(sweep.decode_hdims) * len(sweep.decode_cases)
              * len(sweep.page_sizes) * len(impls.get("decode", []))
              + base * len(sweep.modes_of("varlen")) * (len(impls.get("varlen", [])) + 1)
              * bool(impls.get("varlen")))
    t0 = time.perf_counter()
    rows, interrupted = [], False
    main_thread = threading.current_thread() is threading.main_thread()
    old_handler = signal.signal(signal.SIGTERM, _raise_interrupted) if main_thread else None
    try:
        with tqdm(total=n_runs, desc="benchmark", unit="run", file=sys.stderr,
                  disable=args.no_progress, mininterval=1.0, dynamic_ncols=True) as progress:
            run_sweep(sweep, args, impls.get("dense", []), timer, progress, rows)
            run_decode(sweep, args, impls.get("decode", []), timer, progress, rows)
            run_varlen(sweep, args, impls.get("varlen", []), dense, timer, progress, rows)
    except (Interrupted, KeyboardInterrupt):
        interrupted = True
        notes.append(f"interrupted after {len(rows)} rows: the tables hold the cases measured so far")
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old_handler)
    env["sweep_seconds"] = round(time.perf_counter() - t0, 1)
    if not rows:
        for n in notes:
            print(f"note: {n}")
        print("nothing measured" + (": interrupted" if interrupted else
                                    ": every requested mode was skipped (see the notes above)"))
        return 3 if interrupted else 0

    plot_title = None if args.no_plots else report.plot_label(env, sweep.batch, sweep.tokens, sweep.nheads)
    names = {fam: [i.name for i in fam_impls] for fam, fam_impls in impls.items()}
    if "varlen" in names:
        names["varlen"].insert(1, OURS_DENSE)
    df, paths, header, md = report.write_outputs(rows, names, env, notes, args.out, plot_title)
    not_ok = df[df["status"] != "ok"]
    print(f"wrote {', '.join(paths.values())} ({env['sweep_seconds']} s sweep)")
    if len(not_ok):
        counts = not_ok.groupby(["impl", "status"]).size()
        print("not measured: " + "; ".join(f"{i} {s} x{c}" for (i, s), c in counts.items())
              + " (see the note column of results.csv)")
    for n in notes:
        print(f"note: {n}")
    print()
    print(header)
    print()
    print(md)
    errors = df[df["impl"].isin([OURS, OURS_DENSE]) & (df["status"] == "error")]
    return 3 if interrupted else 1 if len(errors) else 0
