"""The benchmark CLI (flash_attn_ext.benchmark, code in flash_attn_ext.bench): runs end to end at
tiny sizes, writes its files, reports finite numbers that agree with each other, and turns
failing peers into statuses. No assertion here is about speed."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

pd = pytest.importorskip("pandas", reason="the benchmark needs the [bench] extra (pandas)")
pytest.importorskip("matplotlib", reason="the benchmark needs the [bench] extra (matplotlib)")
pytest.importorskip("tqdm", reason="the benchmark needs the [bench] extra (tqdm)")

from flash_attn_ext import benchmark  # noqa: E402
from flash_attn_ext.bench import cli  # noqa: E402
from flash_attn_ext.reference import attention_flops  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = benchmark.OURS

CPU_RUN = ["--device", "cpu", "--dtype", "fp32", "--hdim", "32", "--seqlen", "32,64",
           "--batch", "1", "--nheads", "4", "--gqa", "1,2", "--mode", "fwd,bwd,fwd_bwd",
           "--causal", "both", "--peers", "sdpa-math,sdpa-cudnn,standard",
           "--rep-ms", "2", "--warmup-ms", "1", "--threads", "1", "--rounds", "2", "--no-progress"]
CUDA_RUN = ["--device", "cuda", "--dtype", "bf16", "--hdim", "64", "--seqlen", "128,256",
            "--batch", "2", "--nheads", "4", "--gqa", "1,2", "--mode", "fwd,bwd,fwd_bwd",
            "--causal", "both", "--rep-ms", "5", "--warmup-ms", "2", "--no-progress"]


def run_cli(args, out_dir):
    proc = subprocess.run([sys.executable, "-m", "flash_attn_ext.benchmark", *args, "--out", str(out_dir)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def check_outputs(proc, out_dir, n_cases, impls, atol):
    for name in ("results.csv", "results.json", "summary.csv", "summary.md", "tflops.png", "memory.png"):
        path = out_dir / name
        assert path.is_file() and path.stat().st_size > 0, f"{name} missing or empty"
    for name in ("tflops.png", "memory.png"):
        assert (out_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{name} is not a PNG"

    df = pd.read_csv(out_dir / "results.csv", keep_default_na=False, na_values=[""])
    assert len(df) == n_cases * len(impls)
    assert set(df["impl"]) == set(impls)

    ours = df[df["impl"] == OURS]
    assert (ours["status"] == "ok").all(), ours[ours["status"] != "ok"][["status", "note"]]
    for col in ("ms", "tflops", "peak_mem_mib", "err_out", "err"):
        assert ours[col].map(math.isfinite).all(), f"{OURS}: non-finite {col}"
    assert (ours["ms"] > 0).all() and (ours["peak_mem_mib"] >= 0).all()
    assert ours[ours["mode"] != "fwd"]["err_grad"].map(math.isfinite).all()

    ok = df[df["status"] == "ok"]
    # --rounds: every measured row says how far its rounds spread (max / min ms, >= 1).
    assert (ok["ms_spread"] >= 1.0).all()
    # TFLOP/s is the standard FLOP count over the median time.
    flops = [attention_flops(r.batch, r.nheads, r.seqlen, r.seqlen, r.hdim, r.causal, r.mode)
             for r in ok.itertuples()]
    assert ok["tflops"].to_numpy() == pytest.approx([f / (ms * 1e-3) / 1e12 for f, ms in
                                                      zip(flops, ok["ms"])], rel=1e-6)
    # ours/peer is the TFLOP/s ratio within the same case.
    keys = benchmark.CASE_KEYS
    ours_tf = ours.set_index(keys)["tflops"]
    for r in ok.itertuples():
        key = tuple(getattr(r, k) for k in keys)
        assert r.ours_over_peer == pytest.approx(ours_tf[key] / r.tflops, rel=1e-6)

    # The accuracy criterion against the same-dtype standard attention, beside the speed.
    std = df[df["impl"] == "standard"].set_index(keys)
    for r in ours.itertuples():
        key = tuple(getattr(r, k) for k in keys)
        assert r.err <= 2 * std.loc[key, "err"] + atol, f"{key}: err {r.err} vs standard {std.loc[key, 'err']}"

    # Standard attention materialises the (N, N) scores per head: its peak is at least that.
    std_fwd = df[(df["impl"] == "standard") & (df["mode"] == "fwd") & (df["status"] == "ok")]
    assert len(std_fwd)
    for r in std_fwd.itertuples():
        elem = torch.empty((), dtype=benchmark.DTYPES[r.dtype]).element_size()
        assert r.peak_mem_mib * 2**20 >= r.batch * r.nheads * r.seqlen ** 2 * elem

    data = json.loads((out_dir / "results.json").read_text())
    assert len(data["results"]) == len(df)
    assert {"command", "torch", "device", "timer"} <= set(data["environment"])
    for rec in data["results"]:
        if rec["impl"] == OURS:
            assert all(rec[c] is not None and math.isfinite(rec[c]) for c in ("ms", "tflops", "err"))

    # The compact table is the last thing on stdout.
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    header = next(ln for ln in lines if ln.startswith("| dtype"))
    assert "| ours |" in header.replace("  ", " ") or " ours " in header
    assert lines[-1].startswith("|") and lines[-1].count("|") == header.count("|")
    body = [ln for ln in lines[lines.index(header) + 2:]]
    assert len(body) == n_cases
    return df


def test_cli_cpu_tiny(tmp_path):
    proc = run_cli(CPU_RUN, tmp_path)
    n_cases = 2 * 2 * 2 * 3  # seqlen x causal x gqa x mode
    df = check_outputs(proc, tmp_path, n_cases, [OURS, "sdpa-math", "sdpa-cudnn", "standard"],
                       atol=2e-5)
    # A backend without a CPU kernel is recorded as n/a, never a crash.
    assert (df[df["impl"] == "sdpa-cudnn"]["status"] == "n/a").all()
    assert (df[df["impl"] == "sdpa-math"]["status"] == "ok").all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA benchmark path needs a CUDA device")
def test_cli_cuda_tiny(tmp_path):
    proc = run_cli(CUDA_RUN, tmp_path)
    impls = [OURS, "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "standard"]
    df = pd.read_csv(tmp_path / "results.csv", keep_default_na=False, na_values=[""])
    impls += sorted(set(df["impl"]) - set(impls))  # flash-attn packages, where installed
    check_outputs(proc, tmp_path, 2 * 2 * 2 * 3, impls, atol=0.0)


@pytest.mark.parametrize("argv, flag", [
    (["--dtype", "int8"], "--dtype"),
    (["--mode", "fwd,sideways"], "--mode"),
    (["--mode", "decode,varlen"], "--mode"),
    (["--seqlen", "128,abc"], "--seqlen"),
    (["--hdim", "60"], "--hdim"),
    (["--device", "cpu", "--nheads", "4", "--gqa", "3"], "--gqa"),
    (["--peers", "sdpa-flash,nope"], "--peers"),
    (["--causal", "maybe"], "--causal"),
    (["--device", "cpu", "--decode-cases", "B1x8192"], "--decode-cases"),
    (["--device", "cpu", "--decode-cases", "B0xN8192"], "--decode-cases"),
    (["--device", "cpu", "--page-size", "0,-16"], "--page-size"),
    (["--device", "cpu", "--page-size", "16,x"], "--page-size"),
    (["--device", "cpu", "--decode-heads", "32:5"], "--decode-heads"),
    (["--device", "cpu", "--decode-heads", "32"], "--decode-heads"),
    (["--device", "cpu", "--decode-hdim", "60"], "--decode-hdim"),
    (["--device", "cpu", "--decode-graph"], "--decode-graph"),
    (["--device", "cpu", "--decode-fill", "0"], "--decode-fill"),
    (["--device", "cpu", "--decode-fill", "1.5"], "--decode-fill"),
    (["--device", "cpu", "--decode-fill", "nan"], "--decode-fill"),
    (["--device", "cpu", "--varlen-lens", "1024,128"], "--varlen-lens"),
    (["--device", "cpu", "--varlen-lens", "128"], "--varlen-lens"),
    (["--device", "cpu", "--varlen-seqs", "64", "--varlen-lens", "128,1024",
      "--varlen-tokens", "100"], "--varlen-tokens"),
    (["--device", "cpu", "--varlen-seqs", "0"], "--varlen-seqs"),
    (["--device", "cpu", "--varlen-dense-seqlen", "-1"], "--varlen-dense-seqlen"),
    (["--device", "cpu", "--rounds", "0"], "--rounds"),
    (["--device", "cpu", "--page-size", "0,24"], "--page-size"),
    (["--device", "cpu", "--varlen-dense-seqlen", "1000"], "--varlen-dense-seqlen"),  # 512 varlen tokens
    (["--device", "cpu", "--rep-ms", "inf"], "--rep-ms"),
    (["--device", "cpu", "--warmup-ms", "nan"], "--warmup-ms"),
])
def test_bad_flag_names_the_flag(argv, flag, tmp_path, capsys):
    assert benchmark.main([*argv, "--out", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert flag in err, err
    assert not (tmp_path / "results.csv").exists()


def test_gqa_is_checked_only_where_a_mode_uses_it():
    """--gqa shapes the dense and varlen sweeps; decode takes its heads from --decode-heads, so a
    decode-only run does not refuse a --gqa the dense heads would not divide."""
    parse = cli.make_parser().parse_args
    sweep = cli.resolve_args(parse(["--device", "cpu", "--mode", "decode", "--gqa", "3"]))
    assert sweep.decode_heads == (8, 2)
    with pytest.raises(benchmark.BenchmarkError, match="--gqa"):
        cli.resolve_args(parse(["--device", "cpu", "--mode", "decode,varlen_fwd", "--gqa", "3"]))


def test_flags_of_a_family_not_run_are_noted():
    """Flags that shape only a family no --mode runs (decode cases in a dense run, seqlens in a
    decode run) give a note saying they were ignored; a family that runs gets none."""
    parse = cli.make_parser().parse_args
    args = parse(["--device", "cpu", "--mode", "fwd", "--decode-cases", "B1xN64", "--page-size", "16",
                  "--varlen-seqs", "3"])
    notes = cli.unused_flag_notes(args, cli.resolve_args(args))
    assert notes == ["--decode-cases, --page-size ignored: no decode mode in --mode",
                     "--varlen-seqs ignored: no varlen mode in --mode"], notes
    args = parse(["--device", "cpu", "--mode", "decode", "--seqlen", "64", "--decode-cases", "B1xN64"])
    assert cli.unused_flag_notes(args, cli.resolve_args(args)) == ["--seqlen ignored: no dense mode in --mode"]


def test_out_that_is_a_file_is_refused_before_the_sweep(tmp_path, capsys):
    """--out naming an existing file: a flag error at once, not a traceback after the sweep."""
    f = tmp_path / "taken"
    f.write_text("")
    assert benchmark.main(["--device", "cpu", "--seqlen", "16", "--hdim", "32", "--mode", "fwd", "--peers", "none",
                           "--out", str(f), "--no-progress"]) == 2
    assert "--out" in capsys.readouterr().err


def test_values_given_twice_are_measured_once(tmp_path):
    """A list flag naming a value twice (or two spellings of one: fp32 / float32, N1k / N1024) runs
    that case once; the tables key rows by these values (a repeated one crashed the report after
    the sweep, losing every result). --varlen-lens MIN,MAX may be equal."""
    run_cli(["--device", "cpu", "--dtype", "fp32,float32", "--hdim", "32,32", "--seqlen", "32,32", "--batch", "1",
             "--nheads", "4", "--gqa", "2,2", "--mode", "fwd,decode,varlen_fwd", "--causal", "false",
             "--decode-cases", "B1xN1k,B1xN1024", "--page-size", "0,0,16", "--decode-hdim", "32,32",
             "--varlen-seqs", "2", "--varlen-tokens", "128", "--varlen-lens", "64,64", "--varlen-dense-seqlen", "64",
             "--peers", "none", "--rep-ms", "1", "--warmup-ms", "1", "--threads", "1", "--no-plots",
             "--no-progress"], tmp_path)
    df = pd.read_csv(tmp_path / "results.csv", keep_default_na=False, na_values=[""])
    assert len(df[df["mode"] == "fwd"]) == 1
    assert sorted(df[df["mode"] == "decode"]["page_size"]) == [0, 16]
    assert set(df[df["mode"] == "decode"]["seqlen_k"]) == {1024}
    assert len(df[(df["mode"] == "varlen_fwd") & (df["impl"] == OURS)]) == 1


def test_cpu_timer_warms_up_for_warmup_ms():
    """The CPU timer spends --warmup-ms in untimed calls before the timed ones (it made one)."""
    import time as _time
    calls = []

    def fn():
        calls.append(1)
        _time.sleep(0.002)
    benchmark.Timer(torch.device("cpu"), warmup_ms=40, rep_ms=4, min_reps=5)(fn)
    assert len(calls) >= 15, len(calls)  # ~20 warm-up calls of 2 ms, then 5 timed


def _raising(exc):
    def fn(q, k, v, softmax_scale, causal):
        raise exc
    return fn


@pytest.mark.parametrize("exc, status", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB"), "OOM"),
    (RuntimeError("No available kernel. Aborting execution."), "n/a"),
    (RuntimeError("No viable backend for scaled_dot_product_attention was found."), "n/a"),
    (ValueError("headdim must be a multiple of 8"), "error"),
])
@pytest.mark.parametrize("mode", ["fwd", "bwd"])
def test_failing_implementation_becomes_a_status(exc, status, mode):
    p = benchmark.Problem.make(1, 16, 2, 2, 32, False, torch.float32, torch.device("cpu"))
    timer = benchmark.Timer(torch.device("cpu"), warmup_ms=1, rep_ms=1)
    row = benchmark.measure(benchmark.Impl("broken", _raising(exc)), p, mode, timer)
    assert row["status"] == status
    assert math.isnan(row["ms"]) and math.isnan(row["tflops"])
    errs = benchmark.measure_errors([benchmark.Impl("broken", _raising(exc))], p, True, 1 << 20, 2)
    assert math.isnan(errs["broken"]["err_out"]) and status in errs["broken"]["err_note"]


def test_measure_interleaved_rotates_and_reports_the_median(monkeypatch):
    """--rounds: round r times the implementations in the order rotated by r // 2, reversed in odd
    rounds (each gets other neighbours; a rotation alone left two implementations in one order);
    each row is the median-time round's, with ms_spread = max / min; a failed implementation is not
    timed again."""
    from flash_attn_ext.bench import timing
    script = {"a": [3.0, 1.0, 2.0], "b": [5.0, 5.5, 4.0], "c": [None]}
    order = []

    def fake_measure(impl, p, mode, timer):
        order.append(impl.name)
        ms = script[impl.name][order.count(impl.name) - 1]
        if ms is None:
            return timing.unmeasured("error", "boom")
        return {"status": "ok", "note": "", "ms": ms, "tflops": 1.0 / ms, "peak_mem_mib": 0.0}

    monkeypatch.setattr(timing, "measure", fake_measure)
    impls = [benchmark.Impl(name, None) for name in "abc"]
    out = benchmark.measure_interleaved(impls, None, "fwd", None, rounds=3)
    assert order == ["a", "b", "c", "b", "a", "b", "a"]  # abc, cba (c failed), bca
    order.clear()
    script.update(a=[1.0, 1.0, 1.0, 1.0], b=[1.0, 1.0, 1.0, 1.0])
    benchmark.measure_interleaved(impls[:2], None, "fwd", None, rounds=4)
    assert order == ["a", "b", "b", "a", "b", "a", "a", "b"]
    order.clear()
    script.update(a=[3.0, 1.0, 2.0], b=[5.0, 5.5, 4.0])
    assert out["a"]["ms"] == 2.0 and out["a"]["tflops"] == 0.5 and out["a"]["ms_spread"] == 3.0
    assert out["b"]["ms"] == 5.0 and out["b"]["ms_spread"] == pytest.approx(5.5 / 4.0)
    assert out["c"]["status"] == "error" and math.isnan(out["c"]["ms_spread"])
    # One round: the single measurement, spread 1.
    order.clear()
    script.update(a=[7.0], b=[8.0])
    one = benchmark.measure_interleaved(impls[:2], None, "fwd", None)
    assert order == ["a", "b"] and one["a"]["ms"] == 7.0 and one["a"]["ms_spread"] == 1.0
    # A failure in a later round: that round's status, and no further rounds.
    order.clear()
    script.update(a=[1.0, None, 2.0])
    late = benchmark.measure_interleaved(impls[:1], None, "fwd", None, rounds=3)
    assert order == ["a", "a"] and late["a"]["status"] == "error" and math.isnan(late["a"]["ms_spread"])
    with pytest.raises(ValueError, match="rounds"):
        benchmark.measure_interleaved(impls, None, "fwd", None, rounds=0)


def test_slow_peer_skipped_above_its_seqlen():
    p = benchmark.Problem.make(1, 64, 2, 2, 32, False, torch.float32, torch.device("cpu"))
    timer = benchmark.Timer(torch.device("cpu"), warmup_ms=1, rep_ms=1)
    impl = benchmark.Impl("slow", benchmark.standard_attention, max_seqlen=32)
    assert benchmark.measure(impl, p, "fwd", timer)["status"] == "skipped"


def test_input_rotation_covers_four_times_l2():
    l2 = 50 * 2**20
    bf16 = torch.bfloat16
    # 16k tokens x 2048 features: q, k, v, out, dout are each 64 MiB > 4 x L2 together.
    assert benchmark.input_sets_needed(8, 2048, 16, 16, 128, bf16, l2) == 1
    # A small problem gets enough sets to exceed 4 x L2, up to the cap.
    n = benchmark.input_sets_needed(1, 1024, 16, 16, 128, bf16, l2)
    one_set = 1024 * 5 * 16 * 128 * 2
    assert n == min(benchmark.MAX_INPUT_SETS, math.ceil(4 * l2 / one_set)) and n > 1


def test_bench_package_is_the_same_command():
    """python -m flash_attn_ext.bench and the flash_attn_ext.benchmark shim are one CLI."""
    from flash_attn_ext import bench

    helps = [subprocess.run([sys.executable, "-m", mod, "--help"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
             for mod in ("flash_attn_ext.benchmark", "flash_attn_ext.bench")]
    assert [h.returncode for h in helps] == [0, 0], helps[1].stderr
    assert helps[0].stdout == helps[1].stdout and "--slow-max-seqlen" in helps[0].stdout
    assert all(getattr(benchmark, name) is getattr(bench, name) for name in bench.__all__)


def test_only_report_imports_pandas_and_matplotlib():
    import ast

    bench_dir = os.path.join(REPO, "flash_attn_ext", "bench")
    for fname in sorted(os.listdir(bench_dir)):
        if not fname.endswith(".py") or fname == "report.py":
            continue
        tree = ast.parse(open(os.path.join(bench_dir, fname)).read())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                    for a in n.names}
        imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not imported & {"pandas", "matplotlib"}, fname


def test_plot_label_names_device_batch_and_heads():
    from flash_attn_ext.bench.report import plot_label

    cpu = plot_label({"device": "cpu", "device_name": "x86_64", "cpu_threads": 1}, 2, None, 4)
    assert cpu == f"CPU x86_64 ({os.cpu_count()} cores, 1 thread), batch 2, 4 heads"
    gpu = plot_label({"device": "cuda:0", "device_name": "NVIDIA H200"}, None, 16384, None)
    assert gpu == "NVIDIA H200, batch = 16384 tokens / seqlen, heads = 2048 / hdim"


# ---- decode (KV cache) and varlen modes -------------------------------------------------------

DECODE_ARGS = ["--decode-cases", "B1xN48,B2xN40", "--page-size", "0,16", "--decode-heads", "4:2",
               "--decode-hdim", "32"]
VARLEN_ARGS = ["--varlen-seqs", "3", "--varlen-tokens", "96", "--varlen-lens", "16,64",
               "--varlen-dense-seqlen", "32"]


def _resolve(argv):
    return benchmark.resolve_args(benchmark.make_parser().parse_args(["--device", "cpu", *argv]))


def test_decode_and_varlen_flags():
    sweep = _resolve(["--mode", "fwd,decode,varlen_bwd", "--decode-cases", "B1xN8192,b64xn32k",
                      "--page-size", "0,16,256", "--decode-heads", "32:8", "--decode-hdim", "64,128",
                      "--varlen-seqs", "64", "--varlen-tokens", "16384", "--varlen-lens", "128,1024",
                      "--varlen-dense-seqlen", "1024"])
    assert sweep.decode_cases == [(1, 8192), (64, 32768)]
    assert sweep.page_sizes == [0, 16, 256] and sweep.decode_heads == (32, 8)
    assert sweep.decode_hdims == [64, 128]
    assert (sweep.varlen_seqs, sweep.varlen_tokens, sweep.varlen_lens) == (64, 16384, (128, 1024))
    assert [sweep.modes_of(f) for f in ("dense", "decode", "varlen")] == [["fwd"], ["decode"], ["varlen_bwd"]]
    assert cli.varlen_dense_shape(sweep) == (16, 1024)
    # The CUDA defaults are the cases: B1 8k / 128k, B8 32k, B64 8k / 32k; GQA 32:8.
    assert cli._decode_cases(cli.DECODE_CASES) == [
        (1, 8192), (1, 131072), (8, 32768), (64, 8192), (64, 32768)]
    # CPU defaults are small and valid.
    cpu = _resolve([])
    assert cpu.page_sizes[0] == 0 and all(b * n <= 4096 for b, n in cpu.decode_cases)


def test_decode_bytes_and_varlen_flops_formulas():
    # K and V of a full cache: 2 * B * Nk * nheads_k * d * elem bytes.
    assert benchmark.decode_kv_bytes(64, 32768, 8, 128, 2) == 2 * 64 * 32768 * 8 * 128 * 2 == 8 * 2**30
    p = benchmark.DecodeProblem.make(2, 40, 4, 2, 32, 16, torch.float32, torch.device("cpu"))
    assert p.kv_bytes() == 2 * 2 * 40 * 2 * 32 * 4
    assert p.rates("decode", 0.5)["tbps"] == pytest.approx(p.kv_bytes() / 0.5e-3 / 1e12)
    # Varlen: the dense count of each sequence alone, summed (never the padded max).
    lens = [100, 30, 7]
    fwd = sum(4 * n * n * 64 * 16 for n in lens)
    assert benchmark.varlen_flops(lens, lens, 16, 64, False) == fwd
    assert benchmark.varlen_flops(lens, lens, 16, 64, True) == fwd / 2
    assert benchmark.varlen_flops(lens, lens, 16, 64, True, "varlen_bwd") == 2.5 * fwd / 2
    assert benchmark.varlen_flops(lens, lens, 16, 64, False, "varlen_fwd") == fwd
    # Equal lengths: the dense count of the same batch.
    assert benchmark.varlen_flops([256] * 64, [256] * 64, 16, 128, True, "varlen_bwd") == \
        attention_flops(64, 16, 256, 256, 128, True, "bwd")
    vp = benchmark.VarlenProblem.make(lens, 4, 2, 32, True, torch.float32, torch.device("cpu"))
    assert vp.cu_seqlens.tolist() == [0, 100, 130, 137] and vp.cu_seqlens.dtype == torch.int32
    assert vp.sets[0][0].shape == (137, 4, 32) and vp.sets[0][1].shape == (137, 2, 32)
    assert vp.rates("varlen_fwd", 2.0)["tflops"] == pytest.approx(
        benchmark.varlen_flops(lens, lens, 4, 32, True) / 2e-3 / 1e12)


def test_mixed_lengths():
    lens = benchmark.mixed_lengths(64, 16384, 128, 1024, seed=0)
    assert len(lens) == 64 and sum(lens) == 16384
    assert min(lens) >= 128 and max(lens) <= 1024 and len(set(lens)) > 16
    assert (min(lens), max(lens)) == (128, 1024)  # seed 0 spans the range
    assert lens == benchmark.mixed_lengths(64, 16384, 128, 1024, seed=0)
    assert lens != benchmark.mixed_lengths(64, 16384, 128, 1024, seed=1)
    assert benchmark.mixed_lengths(4, 64, 16, 64) == [16] * 4
    assert benchmark.mixed_lengths(4, 256, 16, 64) == [64] * 4
    for seed in range(20):
        odd = benchmark.mixed_lengths(7, 333, 10, 90, seed)
        assert sum(odd) == 333 and min(odd) >= 10 and max(odd) <= 90
    with pytest.raises(ValueError):
        benchmark.mixed_lengths(64, 100, 128, 1024)


def test_paged_decode_problem_gathers_the_contiguous_cache():
    cpu = torch.device("cpu")
    p = benchmark.DecodeProblem.make(3, 40, 4, 2, 8, 16, torch.float32, cpu)
    q, k, v, _ = p.sets[0]
    assert k.shape == (3 * 3, 16, 2, 8) and p.block_table.shape == (3, 3)
    assert p.block_table.dtype == torch.int32
    assert sorted(p.block_table.flatten().tolist()) == list(range(9))  # a permutation
    assert p.cache_seqlens.tolist() == [40] * 3 and q.shape == (3, 1, 4, 8)
    kc, vc = p.contiguous_cache()
    assert kc.shape == (3, 40, 2, 8)
    b, j = 2, 35  # token 35 of sequence 2: page 2, row 3
    assert torch.equal(kc[b, j], k[p.block_table[b, 2], 3])
    contig = benchmark.DecodeProblem.make(2, 40, 4, 2, 8, 0, torch.float32, cpu)
    assert contig.block_table is None and contig.sets[0][1].shape == (2, 40, 2, 8)


def test_peer_call_shapes():
    """Each FlashAttention peer gets the keywords its own API names (decode and varlen)."""
    from flash_attn_ext.bench import peers

    calls = []

    def record(*args, **kw):
        calls.append(kw)
        return args[0], None

    table, seqlens = torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    for name in ("flash-attn", "flash-attn3", "flash-attn4"):
        fn = peers._fa_decode(name, record)
        assert fn("q", "k", "v", seqlens, table, 0.5) == "q"
    fa2, fa3, fa4 = calls
    assert fa2["block_table"] is table and fa2["cache_seqlens"] is seqlens
    assert fa3["page_table"] is table and fa3["cache_seqlens"] is seqlens
    assert fa4["page_table"] is table and fa4["seqused_k"] is seqlens and "num_splits" not in fa4
    assert all(c["softmax_scale"] == 0.5 and c["causal"] is False for c in calls)
    calls.clear()
    assert peers._varlen_keyword_call(record)("q", "k", "v", "cu", "cu", 9, 9, 0.5, True) == "q"
    assert calls[0] == dict(cu_seqlens_q="cu", cu_seqlens_k="cu", max_seqlen_q=9, max_seqlen_k=9,
                            softmax_scale=0.5, causal=True)
    calls.clear()
    peers._ours_decode(record)("q", "k", "v", seqlens, None, 0.5)
    assert calls[0]["num_splits"] == 0 and calls[0]["block_table"] is None
    # SDPA has no paged entry: 'n/a', never a crash.
    impls, _ = benchmark.build_impls(["sdpa-math"], torch.device("cpu"), None, ours=record,
                                     family="decode")
    p = benchmark.DecodeProblem.make(1, 32, 2, 1, 8, 16, torch.float32, torch.device("cpu"))
    timer = benchmark.Timer(torch.device("cpu"), warmup_ms=1, rep_ms=1)
    row = benchmark.measure(impls[1], p, "decode", timer)
    assert row["status"] == "n/a" and "contiguous" in row["note"] and math.isnan(row["tbps"])
    _, notes = benchmark.build_impls(["sdpa-flash", "standard"], torch.device("cpu"), None,
                                     ours=record, family="varlen")
    assert notes == ["sdpa-flash, standard skipped for varlen: no varlen entry"]


def _fake_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, block_table=None,
                  softmax_scale=None, causal=False, num_splits=0, return_lse=False):
    """flash_attn_with_kvcache's semantics from the dense op, one sequence at a time (the
    pipeline test's stand-in where the build predates the real entry)."""
    from flash_attn_ext import flash_attn_func

    if block_table is not None:
        k_cache = k_cache[block_table.long()].flatten(1, 2)
        v_cache = v_cache[block_table.long()].flatten(1, 2)
    return torch.cat([flash_attn_func(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n],
                                      softmax_scale=softmax_scale, causal=causal)
                      for b, n in enumerate(cache_seqlens.tolist())])


def _fake_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                 softmax_scale=None, causal=False, return_lse=False):
    from flash_attn_ext import flash_attn_func

    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return torch.cat([flash_attn_func(q[a:b][None], k[c:d][None], v[c:d][None], softmax_scale=softmax_scale,
                                      causal=causal)[0]
                      for a, b, c, d in zip(cq[:-1], cq[1:], ck[:-1], ck[1:])])


def _has_entries():
    from flash_attn_ext.bench.peers import ours_entry

    return all(ours_entry(n) is not None for n in ("flash_attn_with_kvcache", "flash_attn_varlen_func"))


NO_ENTRIES = "this build has no flash_attn_with_kvcache / flash_attn_varlen_func"


def _check_decode_varlen_outputs(out, stdout, impls_decode, impls_varlen):
    df = pd.read_csv(out / "results.csv", keep_default_na=False, na_values=[""])
    dec, var = df[df["mode"] == "decode"], df[df["mode"].str.startswith("varlen")]
    n_decode = 2 * 2  # cases x page sizes
    assert len(dec) == n_decode * len(impls_decode)
    assert (dec["timing"] == "eager").all()
    assert len(var) == 2 * 2 * (len(impls_varlen) + 1)  # causal x modes x (impls + ours-dense)
    for part in (dec, var):
        ours = part[part["impl"] == OURS]
        assert (ours["status"] == "ok").all(), ours[["status", "note"]]
        assert ours["err"].map(math.isfinite).all() and (ours["err"] < 1e-4).all()
    # TB/s = K+V bytes / median time; ours/peer = the TB/s ratio in the same case.
    ok = dec[dec["status"] == "ok"]
    nbytes = [benchmark.decode_kv_bytes(r.batch, r.seqlen_k, r.nheads_k, r.hdim, 4) for r in ok.itertuples()]
    assert ok["tbps"].to_numpy() == pytest.approx([b / (ms * 1e-3) / 1e12 for b, ms in zip(nbytes, ok["ms"])],
                                                  rel=1e-6)
    ours_tb = ok[ok["impl"] == OURS].set_index(benchmark.DECODE_KEYS)["tbps"]
    for r in ok.itertuples():
        assert r.ours_over_peer == pytest.approx(ours_tb[tuple(getattr(r, k) for k in benchmark.DECODE_KEYS)]
                                                 / r.tbps, rel=1e-6)
    paged_sdpa = dec[(dec["impl"] == "sdpa-math") & (dec["page_size"] > 0)]
    assert len(paged_sdpa) and (paged_sdpa["status"] == "n/a").all()
    # Varlen TFLOP/s on the real per-sequence work; ours-dense on its own dense shape.
    lens = benchmark.mixed_lengths(3, 96, 16, 64, seed=0)
    okv = var[var["status"] == "ok"]
    for r in okv.itertuples():
        if r.impl == benchmark.OURS_DENSE:
            flops = attention_flops(3, r.nheads, 32, 32, r.hdim, r.causal, r.mode[len("varlen_"):])
            assert (r.batch, r.seqlen) == (3, 32)
        else:
            flops = benchmark.varlen_flops(lens, lens, r.nheads, r.hdim, r.causal, r.mode)
        assert r.tflops == pytest.approx(flops / (r.ms * 1e-3) / 1e12, rel=1e-6)
    assert set(var[var["impl"] == OURS][["min_len", "max_len", "tokens"]].itertuples(index=False)) == \
        {(min(lens), max(lens), 96)}
    for name in ("summary_decode.csv", "summary_varlen.csv", "summary.csv", "summary.md"):
        assert (out / name).is_file()
    # Tables: decode, varlen, then the dense table last on stdout.
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    heads = [i for i, ln in enumerate(lines) if ln.startswith("| dtype")]
    assert len(heads) == 3
    assert "page" in lines[heads[0]] and "ours/contig" in lines[heads[0]] and "timing" in lines[heads[0]]
    assert "ours-dense" in lines[heads[1]] and "ours/ours-dense" in lines[heads[1]]
    assert "|    N |" in lines[heads[2]] or " N " in lines[heads[2]]
    assert lines[heads[0] - 1].startswith("Decode (KV cache)") and lines[heads[1] - 1].startswith("Varlen")
    assert sum(ln.startswith("|") for ln in lines[heads[0]:heads[1]]) == 2 + n_decode
    assert lines[-1].startswith("|")


MIXED_RUN = ["--device", "cpu", "--dtype", "fp32", "--hdim", "32", "--seqlen", "32", "--batch", "1",
             "--nheads", "4", "--mode", "fwd,decode,varlen_fwd,varlen_bwd", "--causal", "both",
             "--peers", "sdpa-math,standard", "--rep-ms", "2", "--warmup-ms", "1", "--threads", "1",
             "--no-progress", "--no-plots", *DECODE_ARGS, *VARLEN_ARGS]


def test_decode_and_varlen_pipeline_cpu(tmp_path, monkeypatch, capsys):
    """The decode / varlen sweep end to end on CPU with stand-ins for the two entries (their
    semantics from the dense op), so the pipeline is tested whatever the build has."""
    import flash_attn_ext

    monkeypatch.setattr(flash_attn_ext, "flash_attn_with_kvcache", _fake_kvcache, raising=False)
    monkeypatch.setattr(flash_attn_ext, "flash_attn_varlen_func", _fake_varlen, raising=False)
    assert benchmark.main([*MIXED_RUN, "--out", str(tmp_path)]) == 0
    _check_decode_varlen_outputs(tmp_path, capsys.readouterr().out, [OURS, "sdpa-math", "standard"], [OURS])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.skipif(not _has_entries(), reason=NO_ENTRIES)
def test_decode_graph_cuda(tmp_path):
    """--decode-graph: every implementation's decode step timed as CUDA graph replays (rows say
    timing graph); ours and SDPA flash are captured and measured, with the errors of the eager
    comparison as in the eager run."""
    proc = run_cli(["--device", "cuda", "--dtype", "bf16", "--mode", "decode", "--decode-graph",
                    "--peers", "sdpa-flash", "--rep-ms", "5", "--warmup-ms", "2", "--no-progress",
                    "--no-plots", "--decode-cases", "B1xN1024,B3xN700", "--page-size", "0,16",
                    "--decode-heads", "8:2", "--decode-hdim", "128"], tmp_path)
    df = pd.read_csv(tmp_path / "results.csv", keep_default_na=False, na_values=[""])
    assert (df["timing"] == "graph").all() and len(df) == 2 * 2 * 2
    ok = df[(df["impl"] == OURS) | (df["page_size"] == 0)]
    assert (ok["status"] == "ok").all(), ok[["impl", "status", "note"]]
    assert (ok["tbps"] > 0).all() and (ok["err"] < 1e-2).all()
    assert re.search(r"\|\s+graph\s+\|", proc.stdout), proc.stdout   # the decode table's timing column


def test_decode_graph_problem_times_replays(monkeypatch):
    """A decode problem with cuda_graph times the calls _graph_replays returns (its eager call is
    never timed); without it, the eager call."""
    from flash_attn_ext.bench import timing
    seen = []

    def fake_replays(f, sets, next_index):
        seen.append(len(sets))
        return lambda: seen.append("replay")

    monkeypatch.setattr(timing, "_graph_replays", fake_replays)
    eager_calls = []
    impl = benchmark.Impl("x", lambda *a: eager_calls.append(1))
    timer = benchmark.Timer(torch.device("cpu"), warmup_ms=1, rep_ms=1)
    for graph in (True, False):
        p = benchmark.DecodeProblem.make(1, 32, 2, 1, 8, 0, torch.float32, torch.device("cpu"), n_sets=2,
                                         cuda_graph=graph)
        timing.time_impl(impl, p, "decode", timer)
        if graph:
            assert seen[0] == 2 and seen.count("replay") >= 3 and not eager_calls
        else:
            assert eager_calls and seen.count("replay") >= 3


@pytest.mark.skipif(not _has_entries(), reason=NO_ENTRIES)
def test_decode_and_varlen_cli_cpu(tmp_path):
    """The same with flash_attn_ext's own entries (their CPU implementations), as a command."""
    proc = run_cli(MIXED_RUN, tmp_path)
    _check_decode_varlen_outputs(tmp_path, proc.stdout, [OURS, "sdpa-math", "standard"], [OURS])


def test_modes_skip_without_the_entries(tmp_path, monkeypatch, capsys):
    """A build without the decode / varlen entries: those modes are skipped with a note; the
    dense modes still run."""
    import flash_attn_ext
    from flash_attn_ext import interface

    for name in ("flash_attn_with_kvcache", "flash_attn_varlen_func"):
        monkeypatch.delattr(flash_attn_ext, name, raising=False)
        monkeypatch.delattr(interface, name, raising=False)
    argv = ["--device", "cpu", "--dtype", "fp32", "--hdim", "32", "--seqlen", "32", "--batch", "1",
            "--nheads", "2", "--peers", "none", "--rep-ms", "1", "--warmup-ms", "1", "--no-progress",
            "--no-plots", "--causal", "false", *DECODE_ARGS, *VARLEN_ARGS]
    assert benchmark.main([*argv, "--mode", "decode,varlen_fwd", "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "decode modes skipped: flash_attn_ext.flash_attn_with_kvcache" in out
    assert "varlen modes skipped: flash_attn_ext.flash_attn_varlen_func" in out
    assert "nothing measured" in out
    assert benchmark.main([*argv, "--mode", "fwd,decode", "--out", str(tmp_path / "b")]) == 0
    df = pd.read_csv(tmp_path / "b" / "results.csv", keep_default_na=False, na_values=[""])
    assert list(df["mode"]) == ["fwd"] and "decode modes skipped" in capsys.readouterr().out


def test_sigterm_writes_the_rows_so_far(tmp_path, monkeypatch, capsys):
    """``timeout`` (SIGTERM) during the varlen part: the dense and decode tables are written,
    exit status 3."""
    import signal

    import flash_attn_ext

    monkeypatch.setattr(flash_attn_ext, "flash_attn_with_kvcache", _fake_kvcache, raising=False)
    monkeypatch.setattr(flash_attn_ext, "flash_attn_varlen_func", _fake_varlen, raising=False)

    def killed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not interrupt the sweep")

    monkeypatch.setattr(cli, "run_varlen", killed)
    before = signal.getsignal(signal.SIGTERM)
    argv = ["--device", "cpu", "--dtype", "fp32", "--hdim", "32", "--seqlen", "32", "--batch", "1",
            "--nheads", "2", "--peers", "none", "--rep-ms", "1", "--warmup-ms", "1", "--no-progress",
            "--no-plots", "--causal", "false", "--mode", "fwd,decode,varlen_fwd", *DECODE_ARGS,
            *VARLEN_ARGS, "--out", str(tmp_path)]
    assert benchmark.main(argv) == 3
    assert signal.getsignal(signal.SIGTERM) == before
    out = capsys.readouterr().out
    assert "interrupted after 5 rows" in out and "Decode (KV cache)" in out
    df = pd.read_csv(tmp_path / "results.csv", keep_default_na=False, na_values=[""])
    assert sorted(df["mode"]) == ["decode"] * 4 + ["fwd"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA benchmark path needs a CUDA device")
@pytest.mark.skipif(not _has_entries(), reason=NO_ENTRIES)
def test_decode_and_varlen_cli_cuda_smoke(tmp_path):
    proc = run_cli(["--device", "cuda", "--dtype", "bf16", "--hdim", "64", "--nheads", "4",
                    "--mode", "decode,varlen_fwd,varlen_bwd", "--causal", "both", "--rep-ms", "5",
                    "--warmup-ms", "2", "--no-progress", "--no-plots",
                    "--decode-cases", "B1xN4096,B4xN1024", "--page-size", "0,16,64",
                    "--decode-heads", "8:2", "--decode-hdim", "128", "--varlen-seqs", "8",
                    "--varlen-tokens", "2048", "--varlen-lens", "64,512",
                    "--varlen-dense-seqlen", "256"], tmp_path)
    df = pd.read_csv(tmp_path / "results.csv", keep_default_na=False, na_values=[""])
    ours = df[df["impl"] == OURS]
    assert len(ours) == 2 * 3 + 2 * 2 and (ours["status"] == "ok").all(), ours[["status", "note"]]
    assert ours["err"].map(math.isfinite).all()
    assert (ours[ours["mode"] == "decode"]["tbps"] > 0).all()
    assert (ours[ours["mode"] != "decode"]["tflops"] > 0).all()
    assert "Decode (KV cache)" in proc.stdout and "ours-dense" in proc.stdout


def test_peer_named_twice_is_measured_once():
    args = cli.make_parser().parse_args(["--device", "cpu", "--peers", "standard,sdpa-math,standard"])
    assert cli.resolve_args(args).peers == ["standard", "sdpa-math"]


# ---- errors on the timed call -----------------------------------------------------------------

def test_error_slice_is_the_reference_of_those_rows():
    """err_slice / err_index: set 0's first and last batch items (decode: sequences, a paged
    cache's pages alone; varlen: every sequence) and KV heads, the first err_kv - 1 and the last,
    with their query heads (query head h of KV head h // group); the float64 reference of the
    slice is the whole problem's reference at those indices, gradients included (batch items and
    KV-head groups do not interact)."""
    cpu = torch.device("cpu")
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    p = benchmark.Problem.make(3, 24, 6, 3, 16, True, torch.float32, cpu, n_sets=2)
    s = p.err_slice(2)
    rows, kv_heads, q_heads = p.err_index(2)
    assert (rows, kv_heads, q_heads) == ([0, 2], [0, 2], [0, 1, 4, 5])
    assert (s.batch, s.nheads, s.nheads_k, len(s.sets)) == (2, 4, 2, 1)
    q, k, v, dout = p.sets[0]
    pick = lambda t, heads: t[rows][:, :, heads]
    assert all(torch.equal(a, b) for a, b in zip(s.sets[0], (pick(q, q_heads), pick(k, kv_heads),
                                                             pick(v, kv_heads), pick(dout, q_heads))))
    (out, grads), (full_out, full_grads) = (benchmark.reference_chunked(x, True) for x in (s, p))
    close(out, pick(full_out, q_heads))
    for g, full, heads in zip(grads, full_grads, (q_heads, kv_heads, kv_heads)):
        close(g, pick(full, heads))
    assert p.err_index(5) == ([0, 2], [0, 1, 2], list(range(6)))  # at most every KV head
    assert benchmark.Problem.make(1, 8, 4, 4, 16, False, torch.float32, cpu).err_index(1) == ([0], [3], [3])
    d = benchmark.DecodeProblem.make(3, 40, 4, 2, 8, 16, torch.float32, cpu, cuda_graph=True)
    ds = d.err_slice(1)
    assert d.err_index(1) == ([0, 2], [1], [2, 3])
    assert (ds.batch, ds.nheads, ds.nheads_k, ds.cuda_graph) == (2, 2, 1, False)
    assert ds.sets[0][1].shape == (6, 16, 1, 8) and ds.block_table.shape == (2, 3)
    assert torch.equal(ds.block_table.flatten().argsort(), d.block_table[[0, 2]].flatten().argsort())
    for part, full in zip(ds.contiguous_cache(), d.contiguous_cache()):
        assert torch.equal(part, full[[0, 2]][:, :, 1:])
    close(benchmark.reference_chunked(ds, False)[0], benchmark.reference_chunked(d, False)[0][[0, 2]][:, :, 2:])
    vp = benchmark.VarlenProblem.make([10, 20, 7], 4, 2, 16, True, torch.float32, cpu)
    vs = vp.err_slice(1)
    assert vp.err_index(1) == (None, [1], [2, 3])
    assert vs.sets[0][0].shape == (37, 2, 16) and vs.sets[0][1].shape == (37, 1, 16)
    (out, grads), (full_out, full_grads) = (benchmark.reference_chunked(x, True) for x in (vs, vp))
    close(out, full_out[:, 2:])
    for g, full in zip(grads, full_grads):
        close(g, full[:, -g.shape[1]:])


@pytest.mark.parametrize("where", ["last row", "last head"])
def test_errors_see_the_end_of_the_grid(where):
    """An implementation wrong only on the last batch item (decode: sequence) or the last query
    head of the call (a grid or 32-bit offset overflow at scale) reports a large error: the errors'
    slice holds the first and the last of each (err_index), not the first ones alone."""
    cpu = torch.device("cpu")

    def wrong_at_the_end(fn):
        def f(q, k, v, *args):
            out = fn(q, k, v, *args).clone()
            if where == "last row":
                out[-1] = 0
            else:
                out[..., -1, :] = 0
            return out

        return f

    cases = [(benchmark.Problem.make(4, 32, 8, 4, 16, True, torch.float32, cpu), "dense"),
             (benchmark.DecodeProblem.make(5, 48, 8, 4, 16, 16, torch.float32, cpu), "decode"),
             (benchmark.DecodeProblem.make(5, 48, 8, 4, 16, 0, torch.float32, cpu), "decode")]
    if where == "last head":
        cases.append((benchmark.VarlenProblem.make([9, 30, 17], 8, 4, 16, True, torch.float32, cpu),
                      "varlen"))
    for p, family in cases:
        ours = benchmark.build_impls([], cpu, None, family=family)[0][0]
        impls = [ours, benchmark.Impl("wrong", wrong_at_the_end(ours.fn))]
        e = benchmark.measure_errors(impls, p, False, None, 2)
        assert e[ours.name]["err_out"] < 1e-4 and e["wrong"]["err_out"] > 0.1, (family, e)


def _wrong_beyond_the_slice(f, rows=None):
    """``f`` (an entry called with q, k, v first) with its output doubled at index 0 of dim 0
    (batch item 0; varlen: the first token) where the call is larger than the errors' slice at
    --err-kv-heads 2: more than 2 KV heads or (``rows``) more than ``rows`` rows in dim 0. Right
    on a problem of the slice's shape alone, which is all the errors used to see."""
    def fn(q, k, v, *args, **kwargs):
        out = f(q, k, v, *args, **kwargs)
        if k.shape[-2] > 2 or (rows is not None and q.shape[0] > rows):
            w = torch.ones(out.shape[0], *[1] * (out.dim() - 1), dtype=out.dtype)
            w[0] = 2.0
            out = out * w
        return out

    return fn


@pytest.mark.parametrize("shape", [
    ["--batch", "2", "--nheads", "2", "--gqa", "1", "--decode-cases", "B3xN40", "--decode-heads", "4:2"],
    ["--batch", "1", "--nheads", "4", "--gqa", "1,2", "--decode-cases", "B1xN40", "--decode-heads", "8:4"],
])
def test_errors_are_those_of_the_timed_call(shape, tmp_path, monkeypatch):
    """An implementation right on small grids but wrong on batch item 0 of a larger call (batch
    over 1, decode over 2 sequences, more KV heads than --err-kv-heads) reports that error: the
    errors come from the timed problem's own call, not from a reduced problem of their own."""
    import flash_attn_ext
    from flash_attn_ext.bench import peers

    monkeypatch.setattr(peers, "_load_ours", lambda: peers._keyword_call(
        _wrong_beyond_the_slice(flash_attn_ext.flash_attn_func, rows=1)))
    monkeypatch.setattr(flash_attn_ext, "flash_attn_with_kvcache",
                        _wrong_beyond_the_slice(_fake_kvcache, rows=2), raising=False)
    monkeypatch.setattr(flash_attn_ext, "flash_attn_varlen_func", _wrong_beyond_the_slice(_fake_varlen),
                        raising=False)
    argv = ["--device", "cpu", "--dtype", "fp32", "--hdim", "32", "--seqlen", "32", "--causal", "false",
            "--mode", "fwd,bwd,decode,varlen_fwd,varlen_bwd", "--peers", "standard", "--err-kv-heads", "2",
            "--page-size", "0,16", "--decode-hdim", "32", *VARLEN_ARGS, "--rep-ms", "1", "--warmup-ms", "1",
            "--threads", "1", "--no-progress", "--no-plots", *shape, "--out", str(tmp_path)]
    assert benchmark.main(argv) == 0
    df = pd.read_csv(tmp_path / "results.csv", keep_default_na=False, na_values=[""])
    ours = df[df["impl"] == OURS]
    n_gqa = len(shape[5].split(","))
    assert len(ours) == n_gqa * (2 + 2) + 2 and (ours["status"] == "ok").all()  # dense, varlen; decode
    for r in ours.itertuples():
        rows = {"decode": 2, "varlen_fwd": math.inf, "varlen_bwd": math.inf}.get(r.mode, 1)
        wrong = r.nheads_k > 2 or (rows < math.inf and r.batch > rows)
        assert (r.err > 0.1) if wrong else (r.err < 1e-4), (r.mode, r.batch, r.nheads_k, r.err)
    assert (df[df["impl"] == "standard"]["err"].dropna() < 1e-4).all()


@pytest.mark.parametrize("exc, fallback", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB"), True),
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 68719476736 bytes"),
     True),
    (ValueError("headdim must be a multiple of 8"), False),
])
def test_errors_on_the_reduced_problem_where_the_full_call_is_out_of_memory(exc, fallback):
    """A full call that fails for memory (peers.classify: OOM): that implementation's errors come
    from the slice's inputs alone, and err_note says so; any other failure stays that status."""
    def fn(q, k, v, softmax_scale, causal):
        if q.shape[2] > 2:  # more query heads than the errors' slice: the full call
            raise exc
        return benchmark.standard_attention(q, k, v, softmax_scale, causal)

    p = benchmark.Problem.make(2, 16, 4, 2, 32, True, torch.float32, torch.device("cpu"))
    impls = [benchmark.Impl("big", fn), benchmark.Impl("std", benchmark.standard_attention)]
    e = benchmark.measure_errors(impls, p, True, None, 1)
    assert e["std"]["err_note"] == "" and e["std"]["err_grad"] < 1e-5
    if fallback:
        assert e["big"]["err_note"] == "errors on reduced problem: full call OOM"
        assert e["big"]["err_out"] < 1e-5 and e["big"]["err_grad"] < 1e-5
    else:
        assert math.isnan(e["big"]["err_out"]) and e["big"]["err_note"].startswith("error: ValueError")


def test_failed_fallback_is_not_noted_as_errors_on_the_reduced_problem():
    """A full call out of memory whose fallback (the slice alone) fails too: NaN errors, and the
    note says both failures without claiming errors on the reduced problem."""
    def fn(q, k, v, softmax_scale, causal):
        if q.shape[2] > 2:  # more query heads than the errors' slice: the full call
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        raise ValueError("headdim must be a multiple of 8")

    p = benchmark.Problem.make(3, 16, 4, 2, 32, True, torch.float32, torch.device("cpu"))
    e = benchmark.measure_errors([benchmark.Impl("big", fn)], p, True, None, 1)["big"]
    assert math.isnan(e["err_out"]) and math.isnan(e["err_grad"])
    assert e["err_note"] == ("full call OOM; on the reduced problem error: ValueError: headdim must be a "
                             "multiple of 8")


def test_fallback_notes_in_the_results(tmp_path, monkeypatch):
    """The standard peer out of memory at the timed size (its rows OOM): its errors from the
    reduced problem, noted; inputs that do not fit: every implementation's errors from a reduced
    problem made on its own, noted."""
    from flash_attn_ext.bench import peers

    def standard_small_only(q, k, v, softmax_scale, causal):
        if q.shape[2] > 2:  # more query heads than the errors' slice: the full call
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return benchmark.standard_attention(q, k, v, softmax_scale, causal)

    monkeypatch.setattr(peers, "standard_attention", standard_small_only)
    argv = ["--device", "cpu", "--dtype", "fp32", "--hdim", "32", "--seqlen", "32", "--batch", "2",
            "--nheads", "4", "--causal", "true", "--mode", "fwd,bwd", "--peers", "standard", "--rep-ms", "1",
            "--warmup-ms", "1", "--threads", "1", "--no-progress", "--no-plots"]
    assert benchmark.main([*argv, "--out", str(tmp_path / "a")]) == 0
    df = pd.read_csv(tmp_path / "a" / "results.csv", keep_default_na=False, na_values=[""])
    std, ours = df[df["impl"] == "standard"], df[df["impl"] == OURS]
    assert (std["status"] == "OOM").all() and (std["err"] < 1e-5).all()
    assert (std["err_note"] == "errors on reduced problem: full call OOM").all()
    assert (ours["status"] == "ok").all() and ours["err_note"].isna().all() and (ours["err"] < 1e-4).all()

    make = benchmark.Problem.make.__func__

    def make_small_only(cls, batch, *args, **kwargs):
        if batch > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return make(cls, batch, *args, **kwargs)

    monkeypatch.setattr(benchmark.Problem, "make", classmethod(make_small_only))
    assert benchmark.main([*argv, "--out", str(tmp_path / "b")]) == 0
    df = pd.read_csv(tmp_path / "b" / "results.csv", keep_default_na=False, na_values=[""])
    assert (df["status"] == "OOM").all() and df["note"].str.startswith("inputs: ").all()
    assert (df["err_note"] == "errors on reduced problem: inputs OOM").all() and (df["err"] < 1e-4).all()


# ---- interleaved groups: a decode case's page sizes, a varlen case's dense twin -----------------

class _Progress:
    """A stand-in for the tqdm bar the sweeps report to."""

    def set_postfix_str(self, text):
        pass

    def update(self, n):
        pass


def _no_errors(impls, p, *args):
    nan = float("nan")
    return {i.name: {"err_out": nan, "err_grad": nan, "err_note": ""} for i in impls}


def _decode_sweep(pages, graph=False, fill=1.0):
    return benchmark.Sweep(torch.device("cpu"), [torch.float32], [16], [False], [32], [1], ["decode"], [],
                           None, 1, 2, decode_cases=[(2, 48)], page_sizes=pages, decode_heads=(4, 2),
                           decode_hdims=[16], decode_graph=graph, decode_fill=fill)


def test_decode_page_sizes_are_timed_in_one_interleaved_group(monkeypatch):
    """Issue 14's bar reads ours/contig: ours on every page size of one (batch, Nk) is timed in the
    same rounds (one measure_group: every round times every page size, ours at each first), not in
    a group per page size at another time (drift between groups biased the ratio); the rows stay
    one per (page size, implementation) in the old order."""
    from flash_attn_ext.bench import sweeps, timing
    seen = []

    def fake_measure(impl, p, mode, timer):
        seen.append((impl.name, p.page_size))
        return {"status": "ok", "note": "", "ms": 1.0 + len(seen), "tbps": 1.0, "peak_mem_mib": 0.0}

    monkeypatch.setattr(timing, "measure", fake_measure)
    monkeypatch.setattr(sweeps, "measure_errors", _no_errors)
    impls = [benchmark.Impl(OURS, None), benchmark.Impl("peer", None)]
    pages, rounds = [0, 16, 32], 3
    args = type("Args", (), dict(seed=0, err_kv_heads=2, rounds=rounds))()
    rows = benchmark.run_decode(_decode_sweep(pages), args, impls, None, _Progress())
    everything = sorted((i.name, page) for i in impls for page in pages)
    n = len(everything)
    assert len(seen) == rounds * n
    for r in range(rounds):  # each round: every implementation at every page size
        assert sorted(seen[r * n:(r + 1) * n]) == everything, (r, seen)
    assert seen[:3] == [(OURS, 0), (OURS, 16), (OURS, 32)]  # round 0: ours at each page size first
    assert [(r["page_size"], r["impl"]) for r in rows] == [(page, i.name) for page in pages for i in impls]
    # Each row is its own entry's median round (the fake ms grows with each call).
    calls = {key: [i + 2.0 for i, k in enumerate(seen) if k == key] for key in set(seen)}
    for r in rows:
        assert r["ms"] == sorted(calls[(r["impl"], r["page_size"])])[1]


def test_decode_group_shares_one_kv_allocation():
    """make_group: one problem per page size over one K/V allocation (a group takes one problem's
    memory), each paged problem's cache the rows of that allocation its own block table names."""
    cpu = torch.device("cpu")
    contig, p16, p32 = benchmark.DecodeProblem.make_group(2, 40, 4, 2, 8, [0, 16, 32], torch.float32, cpu,
                                                          n_sets=2)
    for i in range(2):
        k0, k16, k32 = (p.sets[i][1] for p in (contig, p16, p32))
        assert k0.untyped_storage().data_ptr() == k16.untyped_storage().data_ptr() == k32.untyped_storage().data_ptr()
        assert contig.sets[i][0] is p16.sets[i][0]  # q
        assert k0.shape == (2, 40, 2, 8) and k16.shape == (2 * 3, 16, 2, 8) and k32.shape == (2 * 2, 32, 2, 8)
    assert p16.block_table.shape == (2, 3) and sorted(p16.block_table.flatten().tolist()) == list(range(6))
    assert contig.block_table is None and contig.cache_seqlens is p16.cache_seqlens
    rows = p32.sets[1][1].reshape(-1, 2, 8)  # the whole allocation of set 1 (the largest cache), a key a row
    assert rows.shape[0] == max(2 * 40, 2 * 3 * 16, 2 * 2 * 32)
    for p, size in ((p16, 16), (p32, 32)):
        kc, _ = p.contiguous_cache(1)
        b, j = 1, 37
        assert torch.equal(kc[b, j], rows[p.block_table[b, j // size] * size + j % size])


def test_decode_group_graph_mode_captures_each_page_size(monkeypatch):
    """--decode-graph with the grouped page sizes: each (implementation, page size) measurement
    captures graphs of its own problem's input sets (_graph_replays gets that page size's cache)."""
    from flash_attn_ext.bench import sweeps, timing
    captured = []

    def fake_replays(f, sets, next_index):
        captured.append(tuple(sets[0][1].shape))
        return lambda: sets[next_index()]

    monkeypatch.setattr(timing, "_graph_replays", fake_replays)
    monkeypatch.setattr(sweeps, "measure_errors", _no_errors)
    impl = benchmark.Impl(OURS, lambda q, k, v, lens, table, scale: q)
    args = type("Args", (), dict(seed=0, err_kv_heads=2, rounds=2))()
    timer = benchmark.Timer(torch.device("cpu"), warmup_ms=1, rep_ms=1)
    rows = benchmark.run_decode(_decode_sweep([0, 16], graph=True), args, [impl], timer, _Progress())
    assert [r["timing"] for r in rows] == ["graph", "graph"] and all(r["status"] == "ok" for r in rows)
    # rounds 0 and 1 (reversed): contiguous, paged, paged, contiguous
    assert captured == [(2, 48, 2, 16), (2 * 3, 16, 2, 16), (2 * 3, 16, 2, 16), (2, 48, 2, 16)]


class _MaskBuilds(list):
    """A stand-in for peers._KEY_MASK that records each build of a decode key mask (eager, or
    inside a simulated CUDA graph capture, where its host sync would raise on CUDA)."""

    capturing = False

    def __init__(self):
        super().__init__()
        self.builds = []

    def __setitem__(self, index, value):
        self.builds.append("capture" if _MaskBuilds.capturing else "eager")
        if _MaskBuilds.capturing:
            raise RuntimeError("operation not permitted when stream is capturing (simulated)")
        super().__setitem__(index, value)


def _capturing_replays(f, sets, next_index):
    """timing._graph_replays without CUDA: the eager call of each set, then each set's call again
    as the 'capture' (a build of the key mask there fails as on CUDA)."""
    for q, k, v, _ in sets:
        f(q, k, v)
    _MaskBuilds.capturing = True
    try:
        for q, k, v, _ in sets:
            f(q, k, v)
    finally:
        _MaskBuilds.capturing = False
    return lambda: sets[next_index()]


@pytest.mark.parametrize("fill", [1.0, 0.5])
def test_decode_key_mask_is_built_before_any_capture(monkeypatch, fill):
    """--decode-graph: the masked peers' key mask (decode_key_mask syncs on its first build) is
    built once per group, in an eager call before any timing (the errors), and every page size's
    timed call, graph capture included, reuses it: all page sizes share one cache_seqlens."""
    from flash_attn_ext.bench import peers, timing
    builds = _MaskBuilds()
    monkeypatch.setattr(peers, "_KEY_MASK", builds)
    monkeypatch.setattr(timing, "_graph_replays", _capturing_replays)
    impls, _ = benchmark.build_impls(["standard", "sdpa-math"], torch.device("cpu"), None, family="decode")
    args = type("Args", (), dict(seed=0, err_kv_heads=2, rounds=3))()
    timer = benchmark.Timer(torch.device("cpu"), warmup_ms=1, rep_ms=1)
    rows = benchmark.run_decode(_decode_sweep([0, 16], graph=True, fill=fill), args, impls, timer, _Progress())
    assert {(r["impl"], r["page_size"]): r["status"] for r in rows} == {
        (OURS, 0): "ok", ("standard", 0): "ok", ("sdpa-math", 0): "ok",
        (OURS, 16): "ok", ("standard", 16): "n/a", ("sdpa-math", 16): "n/a"}
    assert builds.builds == ["eager"]


def test_decode_key_mask_cold_is_built_in_the_eager_memory_call(monkeypatch):
    """Without an errors pass first, the mask's first build is measure()'s eager peak-memory call,
    still before the capture; the input sets (n_sets > 1) share the problem's cache_seqlens."""
    from flash_attn_ext.bench import peers, timing
    builds = _MaskBuilds()
    monkeypatch.setattr(peers, "_KEY_MASK", builds)
    monkeypatch.setattr(timing, "_graph_replays", _capturing_replays)
    impls, _ = benchmark.build_impls(["standard"], torch.device("cpu"), None, family="decode")
    group = benchmark.DecodeProblem.make_group(4, 64, 4, 2, 16, [0, 16], torch.float32, torch.device("cpu"),
                                               n_sets=3, cuda_graph=True, fill=0.5)
    assert group[0].cache_seqlens is group[1].cache_seqlens
    timer = benchmark.Timer(torch.device("cpu"), warmup_ms=1, rep_ms=1)
    out = benchmark.measure_group([((p.page_size, i.name), i, p) for i in impls for p in group], "decode",
                                  timer, rounds=2)
    assert out[(0, "standard")]["status"] == "ok" and out[(16, "standard")]["status"] == "n/a"
    assert builds.builds == ["eager"]


def test_varlen_row_and_its_dense_twin_in_one_interleaved_group(monkeypatch):
    """ours on the varlen batch and ours-dense (the same work, dense) are timed in the same rounds
    (ours-dense right after ours in round 0), each row with its own problem's count."""
    from flash_attn_ext.bench import sweeps, timing
    seen = []

    def fake_measure(impl, p, mode, timer):
        seen.append((impl.name, type(p).__name__, mode))
        row = {"status": "ok", "note": "", "ms": 2.0, "peak_mem_mib": 0.0}
        row.update(p.rates(mode, 2.0))
        return row

    monkeypatch.setattr(timing, "measure", fake_measure)
    monkeypatch.setattr(sweeps, "measure_errors", _no_errors)
    sweep = benchmark.Sweep(torch.device("cpu"), [torch.float32], [16], [False], [32], [1],
                            ["varlen_fwd", "varlen_bwd"], [], None, 1, 2, varlen_seqs=3, varlen_tokens=96,
                            varlen_lens=(16, 64), varlen_dense_seqlen=32)
    impls = [benchmark.Impl(OURS, None), benchmark.Impl("peer", None)]
    dense = benchmark.Impl(benchmark.OURS_DENSE, None)
    args = type("Args", (), dict(seed=0, err_kv_heads=2, rounds=2, ref_max_seqlen=None))()
    rows = benchmark.run_varlen(sweep, args, impls, dense, None, _Progress())
    names = [OURS, benchmark.OURS_DENSE, "peer"]
    for mode_index, mode in enumerate(("varlen_fwd", "varlen_bwd")):
        for r in range(2):
            chunk = seen[(2 * mode_index + r) * 3:(2 * mode_index + r + 1) * 3]
            assert sorted(name for name, _, _ in chunk) == sorted(names), chunk
            assert {m for _, _, m in chunk} == {mode}
        assert [name for name, _, _ in seen[6 * mode_index:6 * mode_index + 2]] == names[:2]  # round 0
    assert {(n, kind) for n, kind, _ in seen} == {(OURS, "VarlenProblem"), ("peer", "VarlenProblem"),
                                                 (benchmark.OURS_DENSE, "Problem")}
    by = {(r["mode"], r["impl"]): r for r in rows}
    for mode in ("varlen_fwd", "varlen_bwd"):
        d = by[(mode, benchmark.OURS_DENSE)]  # the dense count of its base mode
        base = mode[len("varlen_"):]
        assert d["tflops"] == pytest.approx(attention_flops(3, 2, 32, 32, 16, False, base) / 2e-3 / 1e12)
        assert (d["batch"], d["seqlen"]) == (3, 32)


# ---- --decode-fill: ragged caches -------------------------------------------------------------------

def test_decode_lengths():
    """--decode-fill F: lengths at the midpoints of B strata of [F*Nk - w, F*Nk + w], w = min(F, 1 - F)
    * Nk, in a seeded order, at least 1; F = 1 is the full cache."""
    assert benchmark.decode_lengths(5, 300, 1.0, seed=3) == [300] * 5
    lens = benchmark.decode_lengths(4, 1000, 0.5, seed=0)
    assert sorted(lens) == [125, 375, 625, 875] and sum(lens) == 0.5 * 4 * 1000
    assert sorted(benchmark.decode_lengths(4, 1000, 0.5, seed=1)) == sorted(lens)
    assert benchmark.decode_lengths(4, 1000, 0.5, seed=0) == lens  # deterministic
    assert sorted(benchmark.decode_lengths(2, 1000, 0.8)) == [700, 900]  # w = 0.2 * Nk
    assert benchmark.decode_lengths(1, 1000, 0.3) == [300]
    assert benchmark.decode_lengths(3, 100, 0.001) == [1, 1, 1]
    many = benchmark.decode_lengths(64, 32768, 0.25, seed=0)
    assert min(many) >= 1 and max(many) <= 16384 and len(set(many)) == 64
    assert sum(many) / 64 == pytest.approx(0.25 * 32768, abs=1)
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="fill"):
            benchmark.decode_lengths(2, 64, bad)


def test_decode_input_sets_cap_the_whole_caches():
    """A ragged decode group rotates input sets by the bytes a call reads, but never allocates more
    than MAX_DECODE_CACHE_BYTES of whole caches (B64 x Nk 32k d128 bf16: 8 GiB a cache; at fill
    0.01 the read bytes alone asked for 3 sets, 24 GiB)."""
    from flash_attn_ext.bench import problems
    l2 = 50 * 2**20
    full = problems.decode_kv_bytes(64, 32768, 8, 128, 2)
    used = problems.decode_kv_bytes(1, int(0.01 * 64 * 32768), 8, 128, 2)
    assert problems.sets_for_bytes(used, l2) == 3
    sets = problems.decode_input_sets(used, full, l2)
    assert sets == 2 and sets * full <= problems.MAX_DECODE_CACHE_BYTES
    small = problems.decode_kv_bytes(1, 8192, 8, 128, 2)  # a full B1 8k cache: rotation as before
    assert problems.decode_input_sets(small, small, l2) == problems.sets_for_bytes(small, l2) > 1
    assert problems.decode_input_sets(10**12, 10**12, l2) == 1  # a cache past the cap: one set


def test_ragged_decode_bytes_count_the_used_lengths():
    cpu = torch.device("cpu")
    for page in (0, 16):
        p = benchmark.DecodeProblem.make(3, 40, 4, 2, 8, page, torch.float32, cpu, fill=0.5, seed=2)
        lens = benchmark.decode_lengths(3, 40, 0.5, seed=2)
        assert p.cache_seqlens.tolist() == lens and sum(lens) < 3 * 40 and p.fill == 0.5
        assert p.kv_bytes() == 2 * sum(lens) * 2 * 8 * 4
        assert p.rates("decode", 0.5)["tbps"] == pytest.approx(2 * sum(lens) * 2 * 8 * 4 / 0.5e-3 / 1e12)
        full = benchmark.DecodeProblem.make(3, 40, 4, 2, 8, page, torch.float32, cpu)
        assert full.kv_bytes() == benchmark.decode_kv_bytes(3, 40, 2, 8, 4)


def _brute_decode(p, b, n):
    """Sequence b's output over its first n keys alone, float64, from the gathered cache."""
    q = p.sets[0][0][b, 0].double()                       # (H, d)
    k, v = (t[b, :n].double() for t in p.contiguous_cache())
    g = p.nheads // p.nheads_k
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (n, H, d)
    s = torch.einsum("hd,nhd->hn", q, k) * p.softmax_scale
    return torch.einsum("hn,nhd->hd", s.softmax(-1), v)


@pytest.mark.parametrize("page", [0, 16])
def test_ragged_decode_reference_reads_only_the_used_keys(page):
    """The float64 reference of a ragged problem (and of its error slice) is that of each
    sequence's used keys alone; an implementation that attends to the whole cache is far off, one
    that honours cache_seqlens (and the masked dense peers) exact."""
    from flash_attn_ext.bench import peers
    from flash_attn_ext.bench.accuracy import reference_chunked

    cpu = torch.device("cpu")
    p = benchmark.DecodeProblem.make(5, 40, 8, 4, 16, page, torch.float32, cpu, fill=0.4)
    lens = p.cache_seqlens.tolist()
    assert len(set(lens)) > 1 and max(lens) < 40
    ref, _ = reference_chunked(p, False)
    for b, n in enumerate(lens):
        torch.testing.assert_close(ref[b, 0], _brute_decode(p, b, n))
    rows, _, q_heads = p.err_index(2)
    part = p.err_slice(2)
    assert part.cache_seqlens.tolist() == [lens[r] for r in rows]
    torch.testing.assert_close(reference_chunked(part, False)[0], ref[rows][:, :, q_heads])
    exact = peers._ours_decode(_fake_kvcache)
    whole = lambda q, k, v, lens, table, scale: exact(q, k, v, torch.full_like(lens, 40), table, scale)
    impls = [benchmark.Impl(OURS, exact), benchmark.Impl("whole-cache", whole)]
    if page == 0:
        more, _ = benchmark.build_impls(["sdpa-math", "standard"], cpu, None, ours=exact, family="decode")
        impls += more[1:]
    errs = benchmark.measure_errors(impls, p, False, None, 2)
    assert errs[OURS]["err_out"] < 1e-5 and errs["whole-cache"]["err_out"] > 1e-2
    for name in ("sdpa-math", "standard")[:2 if page == 0 else 0]:
        assert errs[name]["err_out"] < 1e-5, (name, errs[name])


def test_ragged_decode_pipeline_cpu(tmp_path, monkeypatch, capsys):
    """--decode-fill 0.5 end to end: rows carry fill 0.5, TB/s counts the used lengths' bytes, the
    masked dense peers are measured on the contiguous cache, and the table shows the fill column
    and says the cache is ragged; a full run has neither."""
    import flash_attn_ext

    monkeypatch.setattr(flash_attn_ext, "flash_attn_with_kvcache", _fake_kvcache, raising=False)
    argv = ["--device", "cpu", "--dtype", "fp32", "--mode", "decode", "--peers", "sdpa-math,standard",
            "--rep-ms", "1", "--warmup-ms", "1", "--threads", "1", "--no-progress", "--no-plots", *DECODE_ARGS]
    assert benchmark.main([*argv, "--decode-fill", "0.5", "--out", str(tmp_path / "f")]) == 0
    out = capsys.readouterr().out
    df = pd.read_csv(tmp_path / "f" / "results.csv", keep_default_na=False, na_values=[""])
    assert (df["fill"] == 0.5).all() and len(df) == 2 * 2 * 3
    ok = df[df["status"] == "ok"]
    assert set(ok["impl"]) == {OURS, "sdpa-math", "standard"}
    assert (ok[ok["impl"] != OURS]["page_size"] == 0).all()
    assert (ok["err"] < 1e-4).all(), ok[["impl", "err"]]
    for r in ok.itertuples():
        used = sum(benchmark.decode_lengths(r.batch, r.seqlen_k, 0.5, seed=0))
        assert r.kv_gb * 1e9 == pytest.approx(2 * used * r.nheads_k * r.hdim * 4)
        assert r.tbps == pytest.approx(2 * used * r.nheads_k * r.hdim * 4 / (r.ms * 1e-3) / 1e12, rel=1e-6)
    env = json.loads((tmp_path / "f" / "results.json").read_text())["environment"]
    assert env["decode_fill"] == 0.5
    head = next(ln for ln in out.splitlines() if ln.startswith("| dtype"))
    assert "| fill |" in head.replace("  ", " ") or " fill " in head
    assert "against a ragged cache, fill F (--decode-fill)" in out
    assert benchmark.main([*argv, "--out", str(tmp_path / "full")]) == 0
    out = capsys.readouterr().out
    head = next(ln for ln in out.splitlines() if ln.startswith("| dtype"))
    assert " fill " not in head and "against a full cache" in out
    full = pd.read_csv(tmp_path / "full" / "results.csv", keep_default_na=False, na_values=[""])
    assert (full["fill"] == 1.0).all()
