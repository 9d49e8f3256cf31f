"""Time and peak memory of one implementation on one case (the cases: flash_attn_ext.bench.problems).

ms: median wall time of one call. CUDA: ``triton.testing.do_bench(return_mode="median")``, which
flushes L2 before each timed call, or (without triton) CUDA events around each call after a
warm-up with the same L2 flush. CPU: ``time.perf_counter`` median, after warmup_ms of untimed
calls. Each call takes the next of the problem's rotated input sets; a decode problem with
``cuda_graph`` (``--decode-graph``) replays a CUDA graph of the call per input set instead
(_graph_replays), so the host's cost of issuing a microseconds-long call is not timed.
tflops / tbps: the problem's count of work (problems: TFLOP/s, or TB/s of K+V read for decode)
over the median time.
Rounds (measure_group, measure_interleaved, ``--rounds R``): every entry of a group (an
implementation on a problem) measured R times, round r in the given order rotated by r // 2 and
reversed in odd rounds; each row is the entry's median-time round, with ms_spread = max / min ms
over its rounds. A group is one case's implementations (dense), one decode (batch, Nk)'s
implementations at every page size (so ours/contig compares timings of the same rounds), one
varlen case's implementations and its ours-dense twin (bench.sweeps).
timed_from / timed_to: the local wall-clock time around the timing of the row's round (format
``YYYY/MM/DD HH:MM:SS.ffffff``, nvidia-smi's timestamp), so that a log of SM clock and power
(``scripts/gpu_run.sh``'s clocks.csv) can be joined to each implementation's timing
(``scripts/clocks_by_impl.py``).
peak_mem_mib: memory allocated at the peak minus what was allocated before, around one forward
(modes fwd, decode, varlen_fwd) or forward + backward (modes bwd, fwd_bwd, varlen_bwd) call: CUDA
from torch.cuda.max_memory_allocated, CPU from the torch profiler's allocation events.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import statistics
import sys
import time
from typing import Callable

import torch

from flash_attn_ext.bench.peers import Impl, run_guarded
from flash_attn_ext.bench.problems import Problem, base_mode

DEFAULT_L2_BYTES = 60 * 1024 * 1024  # H200; used when the device does not report its L2 size


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Median milliseconds of ``fn()``; see the module docstring for the method per device."""

    def __init__(self, device: torch.device, warmup_ms: float, rep_ms: float, min_reps: int = 3):
        self.device, self.warmup_ms, self.rep_ms, self.min_reps = device, warmup_ms, rep_ms, min_reps
        self.do_bench = None
        if device.type == "cuda":
            try:
                from triton.testing import do_bench
                self.do_bench = do_bench
                params = inspect.signature(do_bench).parameters
                # return_mode="median" where this triton has it, else the 0.5 quantile
                self.median_kw = {"return_mode": "median"} if "return_mode" in params \
                    else {"quantiles": [0.5]}
            except Exception:
                self.do_bench = None
        if device.type == "cpu":
            self.method = "time.perf_counter median"
        elif self.do_bench is not None:
            self.method = "triton.testing.do_bench median (L2 flushed before each call)"
        else:
            self.method = "CUDA events median (L2 flushed before each call)"

    def __call__(self, fn: Callable) -> float:
        if self.device.type == "cpu":
            return self._cpu(fn)
        if self.do_bench is not None:
            ms = self.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, **self.median_kw)
            return float(ms[0] if isinstance(ms, (list, tuple)) else ms)
        return self._cuda_events(fn)

    def _cpu(self, fn):
        t0 = time.perf_counter()
        fn()  # the first warm-up call, also the estimate
        est = max(time.perf_counter() - t0, 1e-6) * 1e3
        for _ in range(min(1000, int(self.warmup_ms / est)) - 1):  # the rest of warmup_ms
            fn()
        reps = max(self.min_reps, min(1000, int(self.rep_ms / est)))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def _cuda_events(self, fn):
        flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=self.device)
        fn()
        torch.cuda.synchronize(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        torch.cuda.synchronize(self.device)
        est = max(start.elapsed_time(end) / 3, 1e-3)
        for _ in range(max(1, int(self.warmup_ms / est))):
            fn()
        reps = max(self.min_reps, int(self.rep_ms / est))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(reps)]
        for s, e in events:
            flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) for s, e in events)


def script_timer(args) -> tuple[torch.device, torch.dtype, Timer]:
    """The diagnostic scripts' device (--device), dtype (bf16 on CUDA, else float32) and Timer
    (--rep-ms of timed repetitions after up to 25 ms of warm-up)."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, dtype, Timer(device, warmup_ms=min(25.0, args.rep_ms), rep_ms=args.rep_ms)


def feature_cost_table(args, cases, timer: Timer, impls: dict, feature: str, ours_plain: str, ours_with: str,
                       peer: str | None) -> None:
    """The diagnostic scripts' table of what a feature costs (softcap_bench.py, alibi_bench.py): per
    case of ``cases`` (bench.problems.dense_cases), causal or not, and mode in ``args.mode`` (fwd,
    fwd_bwd), TFLOP/s (reference.attention_flops) of each of ``impls`` ({name: call(q, k, v, causal)}),
    medians over ``args.rounds`` alternated rounds, then ours_with / ours_plain and ours_with / peer
    (None or absent: "-"). An implementation that raises is "n/a (its exception)" for the case."""
    from flash_attn_ext.reference import attention_flops

    names = list(impls)
    print("| case | " + " | ".join(f"{n} TFLOP/s" for n in names) + f" | {feature} / plain | ours / {peer or 'peer'} |")
    print("|---" * (len(names) + 3) + "|")
    for d, n, batch, nheads, q, k, v, dout in cases:
        for causal in (False, True):
            for mode in args.mode.split(","):
                flops = attention_flops(batch, nheads, n, n, d, causal, mode)

                def run(name):
                    if mode == "fwd":
                        with torch.no_grad():
                            impls[name](q, k, v, causal)
                    else:
                        torch.autograd.grad(impls[name](q, k, v, causal), (q, k, v), dout)

                t = {name: [] for name in names}
                failed = {}
                for _ in range(args.rounds):
                    for name in names:
                        if name in failed:
                            continue
                        try:
                            t[name].append(timer(lambda: run(name)))
                        except Exception as e:  # e.g. a peer without this feature's path
                            failed[name] = type(e).__name__
                tf = {name: (flops / statistics.median(t[name]) / 1e9 if name not in failed else None)
                      for name in names}
                cells = [f"{tf[x]:.4g}" if tf[x] else f"n/a ({failed[x]})" for x in names]
                ratio = f"{tf[ours_with] / tf[ours_plain]:.3f}" if tf[ours_with] and tf[ours_plain] else "-"
                vs = f"{tf[ours_with] / tf[peer]:.3f}" if peer and tf.get(peer) and tf[ours_with] else "-"
                label = f"d{d} N{n} {'causal' if causal else 'full'} {mode}"
                print(f"| {label} | " + " | ".join(cells) + f" | {ratio} | {vs} |")


def l2_bytes(device: torch.device) -> int:
    """The device's L2 cache size (DEFAULT_L2_BYTES where it reports none); 0 on CPU."""
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or DEFAULT_L2_BYTES)


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (the profiler's C++ start/stop log lines)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _cpu_peak_bytes(fn: Callable) -> float:
    """Peak of the running sum of CPU allocations minus frees during ``fn()``, from the torch
    profiler's memory events; NaN if this torch's profiler does not expose them."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns())
    except AttributeError:
        return float("nan")
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return float(peak)


def peak_extra_memory_mib(impl: Impl, p: Problem, mode: str) -> float:
    """Peak memory above what was allocated before one forward (modes fwd, decode, varlen_fwd)
    or forward+backward call, in MiB. CUDA: torch.cuda.max_memory_allocated; CPU: the
    profiler's allocation events."""
    grad = base_mode(mode) != "fwd"
    q, k, v, dout = p.inputs(grad=grad)
    f = p.bind(impl)

    def one_call():
        out = f(q, k, v)
        if grad:
            torch.autograd.grad(out, (q, k, v), dout)

    if p.device.type != "cuda":
        return _cpu_peak_bytes(one_call) / 2**20
    _synchronize(p.device)
    torch.cuda.reset_peak_memory_stats(p.device)
    base = torch.cuda.memory_allocated(p.device)
    one_call()
    _synchronize(p.device)
    return (torch.cuda.max_memory_allocated(p.device) - base) / 2**20


def _now() -> str:
    """Local wall-clock time in nvidia-smi's timestamp format (module docstring: timed_from)."""
    return datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")


def _graph_replays(f: Callable, sets: list, next_index: Callable[[], int]) -> Callable:
    """``f(q, k, v)`` of every input set captured as a CUDA graph (after one eager call of each
    on a side stream, as torch.cuda.graph asks), and a call that replays the next set's graph:
    the GPU's time of the step without the host's cost of issuing it. Each graph is replayed once
    and its output compared with the eager call's (the dtype's default tolerance), so a call
    whose capture froze something the eager call computes afresh is an error, not a fast row. A
    call that cannot be captured, or whose replay differs, raises (the row then reads status
    error with the reason)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = [f(q, k, v) for q, k, v, _ in sets]
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for (q, k, v, _), expected in zip(sets, eager):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            captured = f(q, k, v)
        g.replay()
        torch.testing.assert_close(captured, expected,
                                   msg=lambda m: f"CUDA graph replay differs from the eager call: {m}")
        graphs.append(g)
    return lambda: graphs[next_index()].replay()


def time_impl(impl: Impl, p: Problem, mode: str, timer: Timer) -> float:
    """Median ms of one call of ``mode``, rotating over the problem's input sets."""
    n = len(p.sets)
    state = {"i": 0}

    def next_index():
        i = state["i"] % n
        state["i"] += 1
        return i

    f = p.bind(impl)
    mode = base_mode(mode)
    if mode == "fwd" and getattr(p, "cuda_graph", False):
        call = _graph_replays(f, p.sets, next_index)
    elif mode == "fwd":
        def call():
            q, k, v, _ = p.sets[next_index()]
            return f(q, k, v)
    elif mode == "bwd":
        leaves = [p.inputs(True, i) for i in range(n)]
        outs = [f(q, k, v) for q, k, v, _ in leaves]

        def call():
            i = next_index()
            q, k, v, dout = leaves[i]
            return torch.autograd.grad(outs[i], (q, k, v), dout, retain_graph=True)
    else:
        leaves = [p.inputs(True, i) for i in range(n)]

        def call():
            q, k, v, dout = leaves[next_index()]
            return torch.autograd.grad(f(q, k, v), (q, k, v), dout)

    return timer(call)


def unmeasured(status: str, note: str, metric: str = "tflops") -> dict:
    """A measurement row without numbers: the given status and note, NaN ms / ``metric``
    (tflops, or tbps for decode) / memory."""
    nan = float("nan")
    return {"status": status, "note": note, "ms": nan, metric: nan, "peak_mem_mib": nan}


def measure(impl: Impl, p: Problem, mode: str, timer: Timer) -> dict:
    """Time and peak memory of one implementation on one case (a Problem, DecodeProblem or
    VarlenProblem). Never raises for a failing implementation: returns status 'n/a' / 'OOM' /
    'error' / 'skipped' with a note instead."""
    if impl.skips(p.seqlen):
        return unmeasured("skipped", f"seqlen > {impl.max_seqlen} (--slow-max-seqlen)", p.METRIC)
    row = unmeasured("ok", "", p.METRIC)

    def body():
        row["peak_mem_mib"] = peak_extra_memory_mib(impl, p, mode)
        row["timed_from"] = _now()
        row["ms"] = time_impl(impl, p, mode, timer)
        row["timed_to"] = _now()

    failure = run_guarded(impl, p.device, body)
    if failure is not None:
        return unmeasured(*failure, p.METRIC)
    row.update(p.rates(mode, row["ms"]))
    return row


def measure_group(entries: list[tuple], mode: str, timer: Timer, rounds: int = 1,
                  before: Callable[[object, int], None] | None = None) -> dict:
    """measure() of every entry ``(key, impl, problem)`` of one group, ``rounds`` times,
    interleaved: round r times them in the given order rotated by r // 2 and, in odd rounds,
    reversed (abc, cba, bca, acb, ...), so none always runs first or right after the same
    neighbour (one round: the given order)
    (GPU clocks and temperature drift over a case; one timed run of each moved single ratios by up
    to 6 % between runs on the H200). Every round times every entry, so the ratio of two entries of
    one group (the same implementation on two problems: a paged decode cache and the contiguous
    one, a varlen batch and its dense twin) is not biased by drift between groups. Returns {key:
    row}: the entry's median-time round (the lower median for an even count), with ``ms_spread``
    = max / min ms over its rounds (1.0 for one). An entry with a round that is not ok gets that
    round's row (ms_spread NaN) and is not timed again. ``before(key, round)``: called before each
    measurement (progress)."""
    if rounds < 1:
        raise ValueError(f"rounds: expected a positive integer, got {rounds}")
    runs: dict = {key: [] for key, _, _ in entries}
    if len(runs) != len(entries):
        raise ValueError("measure_group: two entries with one key")
    n = len(entries)
    for r in range(rounds):
        order = [entries[(k + r // 2) % n] for k in range(n)]
        for key, impl, p in order[::-1] if r % 2 else order:
            done = runs[key]
            if any(m["status"] != "ok" for m in done):
                continue
            if before is not None:
                before(key, r)
            done.append(measure(impl, p, mode, timer))
    out = {}
    for key, _, _ in entries:
        done = runs[key]
        if any(m["status"] != "ok" for m in done):
            row = next(m for m in done if m["status"] != "ok")
            out[key] = {**row, "ms_spread": float("nan")}
            continue
        ordered = sorted(done, key=lambda m: m["ms"])
        row = ordered[(len(ordered) - 1) // 2]
        out[key] = {**row, "ms_spread": ordered[-1]["ms"] / ordered[0]["ms"]}
    return out


def measure_interleaved(impls: list[Impl], p, mode: str, timer: Timer, rounds: int = 1,
                        before: Callable[[Impl, int], None] | None = None) -> dict[str, dict]:
    """measure_group of every implementation on one case (one problem ``p``), keyed by
    implementation name: ``rounds`` interleaved rounds, round r in the given order rotated by
    r // 2 and reversed in odd rounds (one round: the given order, ours first); each row the
    implementation's median-time round with ``ms_spread``. ``before(impl, round)``: called before
    each measurement (progress)."""
    by_name = {impl.name: impl for impl in impls}
    return measure_group([(impl.name, impl, p) for impl in impls], mode, timer, rounds,
                         None if before is None else lambda name, r: before(by_name[name], r))
