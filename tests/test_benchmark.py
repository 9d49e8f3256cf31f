"""The benchmark CLI (flash_attn_ext.benchmark, code in flash_attn_ext.bench): runs end to end at
tiny sizes, writes its files, reports finite numbers that agree with each other, and turns
failing peers into statuses. No assertion here is about speed."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

pd = pytest.importorskip("pandas", reason="the benchmark needs the [bench] extra (pandas)")
pytest.importorskip("matplotlib", reason="the benchmark needs the [bench] extra (matplotlib)")
pytest.importorskip("tqdm", reason="the benchmark needs the [bench] extra (tqdm)")

from flash_attn_ext import benchmark  # noqa: E402
from flash_attn_ext.reference import attention_flops  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = benchmark.OURS

CPU_RUN = ["--device", "cpu", "--dtype", "fp32", "--hdim", "32", "--seqlen", "32,64",
           "--batch", "1", "--nheads", "4", "--gqa", "1,2", "--mode", "fwd,bwd,fwd_bwd",
           "--causal", "both", "--peers", "sdpa-math,sdpa-cudnn,standard",
           "--rep-ms", "2", "--warmup-ms", "1", "--threads", "1", "--no-progress"]
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
    (["--seqlen", "128,abc"], "--seqlen"),
    (["--hdim", "60"], "--hdim"),
    (["--device", "cpu", "--nheads", "4", "--gqa", "3"], "--gqa"),
    (["--peers", "sdpa-flash,nope"], "--peers"),
    (["--causal", "maybe"], "--causal"),
])
def test_bad_flag_names_the_flag(argv, flag, tmp_path, capsys):
    assert benchmark.main([*argv, "--out", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert flag in err, err
    assert not (tmp_path / "results.csv").exists()


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
    errs = benchmark.measure_errors([benchmark.Impl("broken", _raising(exc))], p, True, 1 << 20)
    assert math.isnan(errs["broken"]["err_out"]) and status in errs["broken"]["err_note"]


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
