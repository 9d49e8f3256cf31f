"""The sweeps: every case of a family x every implementation, one result row each, appended to a
list as it is measured (so an interrupted run still has the rows so far).

    run_sweep    dense: (dtype, hdim, causal, gqa, seqlen) x modes fwd / bwd / fwd_bwd
    run_decode   decode: (dtype, decode hdim, B x Nk case, page size), mode decode
    run_varlen   varlen: (dtype, hdim, causal, gqa) x modes varlen_fwd / varlen_bwd, each with the
                 ours-dense comparison row (flash_attn_func on as many tokens, varlen_dense_shape)

Interleaved groups (timing.measure_group, --rounds): a dense case's implementations; a decode
(dtype, hdim, B x Nk)'s implementations at every page size (ours at each page size first, then
each peer at each page size), so that ours/contig divides timings of the same rounds; a varlen
case and mode's implementations and its ours-dense row (second, after ours), so that
ours/ours-dense does too.

Each case's errors come from each implementation's call on the timed problem's first input set,
compared over a slice of it (first and last batch items, --err-kv-heads KV heads; accuracy),
before the timing; its inputs that do not fit give every implementation the status of that
failure instead of a number, and errors from a reduced problem of the slice's shape made on its
own (err_note says so).
"""

from __future__ import annotations

import dataclasses

import torch

from flash_attn_ext.bench import report
from flash_attn_ext.bench.accuracy import measure_errors
from flash_attn_ext.bench.peers import Impl, classify, free_memory
from flash_attn_ext.bench.problems import (DecodeProblem, Problem, VarlenProblem, decode_kv_bytes,
                                           decode_input_sets, decode_lengths, input_sets_needed,
                                           mixed_lengths)
from flash_attn_ext.bench.timing import Timer, l2_bytes, measure_group, unmeasured

DENSE_MODES = ("fwd", "bwd", "fwd_bwd")
VARLEN_MODES = ("varlen_fwd", "varlen_bwd")
MODES = DENSE_MODES + ("decode",) + VARLEN_MODES
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


@dataclasses.dataclass
class Sweep:
    """The resolved flags (cli.resolve_args): the dense lists, then decode's and varlen's."""

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
    decode_cases: list = dataclasses.field(default_factory=list)
    page_sizes: list = dataclasses.field(default_factory=list)
    decode_heads: tuple = (32, 8)
    decode_hdims: list = dataclasses.field(default_factory=list)
    decode_graph: bool = False
    decode_fill: float = 1.0
    varlen_seqs: int = 64
    varlen_tokens: int = 16384
    varlen_lens: tuple = (128, 1024)
    varlen_dense_seqlen: int = 1024

    def modes_of(self, fam: str) -> list:
        """The requested modes of one family: dense, decode or varlen."""
        return [m for m in self.modes if report.family(m) == fam]


def varlen_dense_shape(sweep: Sweep) -> tuple[int, int]:
    """(batch, seqlen) of the ours-dense comparison row: as many tokens as the varlen batch."""
    return max(1, sweep.varlen_tokens // sweep.varlen_dense_seqlen), sweep.varlen_dense_seqlen


def run_sweep(sweep: Sweep, args, impls: list[Impl], timer: Timer, progress,
              rows: list | None = None) -> list[dict]:
    """Every (dtype, hdim, causal, gqa, seqlen, mode) case x implementation: one row each,
    appended to ``rows`` (a new list by default) as it is measured; returns ``rows``."""
    rows = [] if rows is None else rows
    modes = sweep.modes_of("dense")
    if not modes:
        return rows
    l2 = l2_bytes(sweep.device)
    need_grad = any(m != "fwd" for m in modes)
    for dtype, hdim, nheads, causal, gqa, nheads_k in _head_configs(sweep):
        for seqlen in sweep.seqlens:
            batch = sweep.batch if sweep.batch is not None else max(1, sweep.tokens // seqlen)
            case = dict(dtype=DTYPE_NAMES[dtype], hdim=hdim, causal=causal, seqlen=seqlen,
                        batch=batch, nheads=nheads, nheads_k=nheads_k, gqa=gqa)
            where = f"{case['dtype']} d={hdim} causal={causal} gqa={gqa} N={seqlen}"
            progress.set_postfix_str(f"{where}: errors")
            err_kv = min(nheads_k, args.err_kv_heads)
            n_sets = input_sets_needed(batch, seqlen, nheads, nheads_k, hdim, dtype, l2) \
                if sweep.device.type == "cuda" else 1
            try:
                p = Problem.make(batch, seqlen, nheads, nheads_k, hdim, causal, dtype,
                                 sweep.device, n_sets=n_sets, seed=args.seed)
                p_status = None
            except Exception as e:  # the inputs themselves do not fit
                p, p_status = None, classify(e)
                free_memory(sweep.device, collect=True)
            errors = _errors(impls, p, p_status, lambda: Problem.make(
                1, seqlen, err_kv * gqa, err_kv, hdim, causal, dtype, sweep.device,
                seed=args.seed + 1), need_grad, args.ref_max_seqlen, err_kv)
            for mode in modes:
                ms = _measured(impls, p, mode, timer, args, progress, f"{where} {mode}", p_status)
                for impl in impls:
                    rows.append(_timed_row(case, mode, impl, ms[impl.name], n_sets, errors[impl.name],
                                           fwd_mode="fwd"))
                    progress.update(1)
            del p
            free_memory(sweep.device)
    return rows


def _measured(impls: list[Impl], p, mode: str, timer: Timer, args, progress, where: str,
              p_status, metric: str = "tflops") -> dict[str, dict]:
    """{impl.name: row} of one case and mode: one interleaved group over ``--rounds`` rounds, or
    every implementation's status row where the inputs did not fit (p is None)."""
    return _measured_group([(impl.name, impl, p, p_status, impl.name) for impl in impls], mode,
                           timer, args, progress, where, metric)


def _measured_group(entries: list[tuple], mode: str, timer: Timer, args, progress, where: str,
                    metric: str) -> dict:
    """{key: row} of ``entries`` (key, impl, problem, its status, label), timed as one interleaved
    group (timing.measure_group) over ``--rounds`` rounds; an entry whose problem's inputs did not
    fit (problem None, status (status, note)) gets that status row instead."""
    rounds = getattr(args, "rounds", 1)
    labels = {key: label for key, _, _, _, label in entries}
    out = {key: unmeasured(status[0], "inputs: " + status[1], metric)
           for key, _, p, status, _ in entries if p is None}

    def before(key, r):
        of = f" (round {r + 1}/{rounds})" if rounds > 1 else ""
        progress.set_postfix_str(f"{where} {labels[key]}{of}")

    group = [(key, impl, p) for key, impl, p, _, _ in entries if p is not None]
    if group:
        out.update(measure_group(group, mode, timer, rounds, before))
    return {key: out[key] for key, _, _, _, _ in entries}


def _errors(impls: list[Impl], p, p_status, reduced, need_grad: bool, ref_max_seqlen,
            err_kv: int) -> dict:
    """measure_errors on the timed problem ``p`` over its slice of ``err_kv`` KV heads; where its
    inputs did not fit (p None, ``p_status``), on ``reduced()`` (a problem of the slice's shape
    with inputs of its own), each err_note saying so."""
    if p is not None:
        return measure_errors(impls, p, need_grad, ref_max_seqlen, err_kv)
    errors = measure_errors(impls, reduced(), need_grad, ref_max_seqlen, err_kv)
    why = f"errors on reduced problem: inputs {p_status[0]}"
    for e in errors.values():
        e["err_note"] = f"{why}; {e['err_note']}" if e["err_note"] else why
    return errors


def _head_configs(sweep: Sweep):
    """(dtype, hdim, nheads, causal, gqa, nheads_k) of every configuration of the sweep, in table
    order (nheads: --nheads, else 2048 / hdim)."""
    for dtype in sweep.dtypes:
        for hdim in sweep.hdims:
            nheads = sweep.nheads if sweep.nheads is not None else max(1, 2048 // hdim)
            for causal in sweep.causals:
                for gqa in sweep.gqas:
                    yield dtype, hdim, nheads, causal, gqa, nheads // gqa


def _timed_row(case: dict, mode: str, impl: Impl, m: dict, n_sets: int, e: dict, fwd_mode: str) -> dict:
    """One result row: the case, the timing ``m`` and the impl's errors (``err``: the output's for
    ``fwd_mode``, the gradients' otherwise)."""
    err = e["err_out"] if mode == fwd_mode else e["err_grad"]
    return {**case, "mode": mode, "impl": impl.name, **m, "n_input_sets": n_sets, "err_out": e["err_out"],
            "err_grad": e["err_grad"], "err": err, "err_note": e["err_note"]}


def _make_or_status(make):
    """(problem, None), or (None, (status, note)) where the inputs themselves do not fit."""
    try:
        return make(), None
    except Exception as e:
        return None, classify(e)


def run_decode(sweep: Sweep, args, impls: list[Impl], timer: Timer, progress,
               rows: list | None = None) -> list[dict]:
    """Every (dtype, decode hdim, decode case, page size) x implementation: one row each, mode
    decode, with fill (--decode-fill), tbps (K+V bytes of the used lengths read / median time),
    kv_gb and timing (eager calls, or graph: replays of CUDA graphs, --decode-graph); appended to
    ``rows``. The page sizes of one (dtype, hdim, case) are made together (DecodeProblem.make_group,
    one K/V allocation) and timed as one interleaved group, ours at every page size first; their
    errors come before (each page size's own call and reference)."""
    rows = [] if rows is None else rows
    if not sweep.modes_of("decode") or not impls:
        return rows
    cuda = sweep.device.type == "cuda"
    l2 = l2_bytes(sweep.device)
    nheads, nheads_k = sweep.decode_heads
    gqa = nheads // nheads_k
    err_kv = min(nheads_k, args.err_kv_heads)
    fill, pages = sweep.decode_fill, list(dict.fromkeys(sweep.page_sizes))
    for dtype in sweep.dtypes:
        for hdim in sweep.decode_hdims:
            for batch, seqlen_k in sweep.decode_cases:
                case = dict(dtype=DTYPE_NAMES[dtype], hdim=hdim, gqa=gqa, nheads=nheads,
                            nheads_k=nheads_k, batch=batch, seqlen_k=seqlen_k)
                rest = dict(mode="decode", timing="graph" if sweep.decode_graph else "eager", fill=fill)
                where = f"decode {case['dtype']} d={hdim} B={batch} Nk={seqlen_k}"
                where += f" fill={fill:g}" if fill < 1 else ""
                progress.set_postfix_str(f"{where}: inputs")
                elem = torch.empty((), dtype=dtype).element_size()
                used = sum(decode_lengths(batch, seqlen_k, fill, seed=args.seed))
                kv_bytes = decode_kv_bytes(1, used, nheads_k, hdim, elem)
                cache_bytes = decode_kv_bytes(batch, seqlen_k, nheads_k, hdim, elem)
                n_sets = decode_input_sets(kv_bytes, cache_bytes, l2) if cuda else 1
                group, status = _make_or_status(lambda: DecodeProblem.make_group(
                    batch, seqlen_k, nheads, nheads_k, hdim, pages, dtype, sweep.device,
                    n_sets=n_sets, seed=args.seed, cuda_graph=sweep.decode_graph, fill=fill))
                if group is None:
                    group = [None] * len(pages)
                    free_memory(sweep.device, collect=True)
                errors = {}
                for page, p in zip(pages, group):
                    progress.set_postfix_str(f"{where} page={page}: errors")
                    errors[page] = _errors(impls, p, status, lambda page=page: DecodeProblem.make(
                        min(batch, 2), seqlen_k, err_kv * gqa, err_kv, hdim, page, dtype,
                        sweep.device, seed=args.seed + 1, fill=fill), False, None, err_kv)
                entries = [((page, impl.name), impl, p, status, f"page={page} {impl.name}")
                           for impl in impls for page, p in zip(pages, group)]  # ours first
                ms = _measured_group(entries, "decode", timer, args, progress, where, "tbps")
                for page in pages:
                    for impl in impls:
                        m, e = ms[(page, impl.name)], errors[page][impl.name]
                        rows.append({**case, "page_size": page, **rest, "impl": impl.name, **m,
                                     "kv_gb": kv_bytes / 1e9, "n_input_sets": n_sets,
                                     "err_out": e["err_out"], "err": e["err_out"],
                                     "err_note": e["err_note"]})
                        progress.update(1)
                del group
                free_memory(sweep.device)
    return rows


def run_varlen(sweep: Sweep, args, impls: list[Impl], dense: Impl, timer: Timer, progress,
               rows: list | None = None) -> list[dict]:
    """Every (dtype, hdim, causal, gqa) x varlen mode x implementation, plus the ``dense`` row
    (flash_attn_func on as many tokens, varlen_dense_shape, in the same interleaved group as the
    implementations, right after ours; its mode's base mode): one row each, with tflops on the
    real per-sequence work; appended to ``rows``."""
    rows = [] if rows is None else rows
    modes = sweep.modes_of("varlen")
    if not modes or not impls:
        return rows
    cuda = sweep.device.type == "cuda"
    l2 = l2_bytes(sweep.device)
    lo, hi = sweep.varlen_lens
    seqlens = mixed_lengths(sweep.varlen_seqs, sweep.varlen_tokens, lo, hi, seed=args.seed)
    total = sum(seqlens)
    dense_batch, dense_seqlen = varlen_dense_shape(sweep)
    need_grad = "varlen_bwd" in modes
    for dtype, hdim, nheads, causal, gqa, nheads_k in _head_configs(sweep):
        case = dict(dtype=DTYPE_NAMES[dtype], hdim=hdim, causal=causal, gqa=gqa,
                    nheads=nheads, nheads_k=nheads_k, n_seqs=len(seqlens), tokens=total,
                    min_len=min(seqlens), max_len=max(seqlens))
        where = f"varlen {case['dtype']} d={hdim} causal={causal} gqa={gqa}"
        progress.set_postfix_str(f"{where}: errors")
        err_kv = min(nheads_k, args.err_kv_heads)
        sets = lambda b, n: input_sets_needed(b, n, nheads, nheads_k, hdim, dtype, l2) \
            if cuda else 1
        n_sets, n_dense = sets(1, total), sets(dense_batch, dense_seqlen)
        p, p_status = _make_or_status(lambda: VarlenProblem.make(
            seqlens, nheads, nheads_k, hdim, causal, dtype, sweep.device,
            n_sets=n_sets, seed=args.seed))
        dense_p, dense_status = _make_or_status(lambda: Problem.make(
            dense_batch, dense_seqlen, nheads, nheads_k, hdim, causal, dtype,
            sweep.device, n_sets=n_dense, seed=args.seed))
        if p is None or dense_p is None:
            free_memory(sweep.device, collect=True)
        errors = _errors(impls, p, p_status, lambda: VarlenProblem.make(
            seqlens, err_kv * gqa, err_kv, hdim, causal, dtype, sweep.device, seed=args.seed + 1),
            need_grad, args.ref_max_seqlen, err_kv)
        for mode in modes:
            entries = [(impl.name, impl, p, p_status, impl.name) for impl in impls]
            entries.insert(1, (dense.name, dense, dense_p, dense_status, dense.name))  # after ours
            ms = _measured_group(entries, mode, timer, args, progress, f"{where} {mode}", "tflops")
            for impl in impls:
                rows.append(_timed_row(case, mode, impl, ms[impl.name], n_sets, errors[impl.name],
                                       fwd_mode="varlen_fwd"))
                progress.update(1)
            m = ms[dense.name]
            shape = f"flash_attn_func at batch {dense_batch} x seqlen {dense_seqlen}"
            m["note"] = f"{shape}; {m['note']}" if m["note"] else shape
            nan = float("nan")
            rows.append({**case, "mode": mode, "impl": dense.name, **m,
                         "batch": dense_batch, "seqlen": dense_seqlen,
                         "n_input_sets": n_dense, "err_out": nan, "err_grad": nan,
                         "err": nan, "err_note": "dense comparison row (errors: the "
                                                 "dense modes)"})
            progress.update(1)
        del p, dense_p
        free_memory(sweep.device)
    return rows
