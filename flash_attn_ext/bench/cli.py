"""Command line: flags, the sweep over cases, and main (``python -m flash_attn_ext.benchmark``)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from flash_attn_ext.bench import report
from flash_attn_ext.bench.accuracy import measure_errors
from flash_attn_ext.bench.peers import (ALL_PEERS, OURS, BenchmarkError, Impl, build_impls,
                                        classify, free_memory)
from flash_attn_ext.bench.timing import Problem, Timer, input_sets_needed, l2_bytes, measure, unmeasured

MODES = ("fwd", "bwd", "fwd_bwd")
DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32,
    "fp64": torch.float64, "float64": torch.float64,
}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def _int_list(flag: str, text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchmarkError(f"{flag}: expected a comma-separated list of integers, got {text!r}")
    if not values or any(x <= 0 for x in values):
        raise BenchmarkError(f"{flag}: expected positive integers, got {text!r}")
    return values


def _choice_list(flag: str, text: str, choices) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in values if x not in choices]
    if not values or bad:
        raise BenchmarkError(f"{flag}: expected a comma-separated list from {sorted(set(choices))}, "
                             f"got {text!r}")
    return values


def _causal_list(text: str) -> list[bool]:
    table = {"both": [False, True], "true": [True], "1": [True], "false": [False], "0": [False]}
    out = []
    for x in text.lower().split(","):
        if x.strip() not in table:
            raise BenchmarkError(f"--causal: expected both, true, false (or 1, 0), got {text!r}")
        out += [c for c in table[x.strip()] if c not in out]
    return out


def _check_positive(flag: str, value, kind: str = "integer") -> None:
    """BenchmarkError naming ``flag`` unless ``value`` is None or > 0."""
    if value is not None and value <= 0:
        raise BenchmarkError(f"{flag}: expected a positive {kind}, got {value}")


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m flash_attn_ext.benchmark",
        description="Benchmark flash_attn_ext against SDPA backends, standard attention and "
                    "FlashAttention (if installed). Defaults depend on the device: on CUDA the "
                    "anchor sweep (bf16, hdim 64,128, causal both, seqlen 512..16384, 16k tokens, "
                    "nheads 2048/hdim, fwd and bwd); on CPU small sizes (fp32, hdim 64, seqlen "
                    "128..512, batch 2, 4 heads).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    ap.add_argument("--mode", default="fwd,bwd", help="comma list of fwd, bwd, fwd_bwd")
    ap.add_argument("--peers", default=",".join(ALL_PEERS),
                    help="comma list of peers to compare against (or 'none')")
    ap.add_argument("--out", default="bench_out", help="output directory")
    ap.add_argument("--quick", action="store_true",
                    help="short sweep (cuda: hdim 128, seqlen 1024,4096; cpu: seqlen 128,256) "
                         "with shorter timing")
    ap.add_argument("--warmup-ms", type=float, default=None, help="warm-up time per measurement "
                    "[25; --quick 10]")
    ap.add_argument("--rep-ms", type=float, default=None, help="time spent in timed repetitions "
                    "per measurement [cuda: 100, cpu: 60; --quick 30]")
    ap.add_argument("--slow-max-seqlen", type=int, default=4096,
                    help="sdpa-math is skipped above this seqlen (it takes seconds per call)")
    ap.add_argument("--ref-max-seqlen", type=int, default=16384,
                    help="errors vs the float64 reference are computed up to this seqlen")
    ap.add_argument("--err-kv-heads", type=int, default=2,
                    help="KV heads of the reduced (batch 1) problem the errors are measured on")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU: torch.set_num_threads (fewer threads than busy cores gives steadier "
                         "times on a shared machine) [torch's default]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--no-plots", action="store_true", help="do not write the PNG plots")
    return ap


@dataclasses.dataclass
class Sweep:
    device: torch.device
    dtypes: list
    hdims: list
    causals: list
    seqlens: list
    gqas: list
    modes: list
    peers: list
    tokens: int | None
    batch: int | None
    nheads: int | None


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
    dtypes = [DTYPES[x] for x in _choice_list("--dtype", args.dtype or ("bf16" if cuda else "fp32"), DTYPES)]
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
    for h in hdims:
        nh = nheads if nheads is not None else max(1, 2048 // h)
        for r in gqas:
            if nh % r:
                raise BenchmarkError(f"--gqa: ratio {r} does not divide nheads={nh} (hdim {h})")
    _check_positive("--warmup-ms", args.warmup_ms, "number")
    _check_positive("--rep-ms", args.rep_ms, "number")
    _check_positive("--threads", args.threads)
    _check_positive("--err-kv-heads", args.err_kv_heads)
    return Sweep(device, dtypes, hdims, _causal_list(args.causal), seqlens, gqas, modes, peers,
                 tokens, batch, nheads)


def run_sweep(sweep: Sweep, args, impls: list[Impl], timer: Timer, progress) -> list[dict]:
    """Every (dtype, hdim, causal, gqa, seqlen, mode) case x implementation: one row each."""
    rows = []
    l2 = l2_bytes(sweep.device)
    need_grad = any(m != "fwd" for m in sweep.modes)
    for dtype in sweep.dtypes:
        for hdim in sweep.hdims:
            nheads = sweep.nheads if sweep.nheads is not None else max(1, 2048 // hdim)
            for causal in sweep.causals:
                for gqa in sweep.gqas:
                    nheads_k = nheads // gqa
                    for seqlen in sweep.seqlens:
                        batch = sweep.batch if sweep.batch is not None else max(1, sweep.tokens // seqlen)
                        case = dict(dtype=DTYPE_NAMES[dtype], hdim=hdim, causal=causal, seqlen=seqlen,
                                    batch=batch, nheads=nheads, nheads_k=nheads_k, gqa=gqa)
                        where = f"{case['dtype']} d={hdim} causal={causal} gqa={gqa} N={seqlen}"
                        progress.set_postfix_str(f"{where}: errors")
                        err_kv = min(nheads_k, args.err_kv_heads)
                        small = Problem.make(1, seqlen, err_kv * gqa, err_kv, hdim, causal, dtype,
                                             sweep.device, seed=args.seed + 1)
                        errors = measure_errors(impls, small, need_grad, args.ref_max_seqlen)
                        del small
                        n_sets = input_sets_needed(batch, seqlen, nheads, nheads_k, hdim, dtype, l2) \
                            if sweep.device.type == "cuda" else 1
                        try:
                            p = Problem.make(batch, seqlen, nheads, nheads_k, hdim, causal, dtype,
                                             sweep.device, n_sets=n_sets, seed=args.seed)
                            p_status = None
                        except Exception as e:  # the inputs themselves do not fit
                            p, p_status = None, classify(e)
                            free_memory(sweep.device, collect=True)
                        for mode in sweep.modes:
                            for impl in impls:
                                progress.set_postfix_str(f"{where} {mode} {impl.name}")
                                if p is None:
                                    m = unmeasured(p_status[0], "inputs: " + p_status[1])
                                else:
                                    m = measure(impl, p, mode, timer)
                                e = errors[impl.name]
                                err = e["err_out"] if mode == "fwd" else e["err_grad"]
                                rows.append({**case, "mode": mode, "impl": impl.name, **m,
                                             "n_input_sets": n_sets, "err_out": e["err_out"],
                                             "err_grad": e["err_grad"], "err": err,
                                             "err_note": e["err_note"]})
                                progress.update(1)
                        del p
                        free_memory(sweep.device)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2: bad flag or environment, 1: flash_attn_ext
    failed on some case, 0 otherwise)."""
    args = make_parser().parse_args(argv)
    try:
        report.require_deps()
        sweep = resolve_args(args)
        impls, notes = build_impls(sweep.peers, sweep.device, args.slow_max_seqlen)
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

    n_cases = (len(sweep.dtypes) * len(sweep.hdims) * len(sweep.causals) * len(sweep.gqas)
               * len(sweep.seqlens) * len(sweep.modes))
    t0 = time.perf_counter()
    with tqdm(total=n_cases * len(impls), desc="benchmark", unit="run", file=sys.stderr,
              disable=args.no_progress, mininterval=1.0, dynamic_ncols=True) as progress:
        rows = run_sweep(sweep, args, impls, timer, progress)
    env["sweep_seconds"] = round(time.perf_counter() - t0, 1)

    plot_title = None if args.no_plots else report.plot_label(env, sweep.batch, sweep.tokens, sweep.nheads)
    df, paths, header, md = report.write_outputs(rows, [i.name for i in impls], env, notes, args.out,
                                                 plot_title)
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
    print(md)
    errors = df[(df["impl"] == OURS) & (df["status"] == "error")]
    return 1 if len(errors) else 0
