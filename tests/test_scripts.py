"""Developer scripts that run without a GPU: scripts/compare_tune.py (the table of
scripts/gpu_ab_tune.sh) on synthetic tune_kernels.py outputs, scripts/compare_runs.py (the table of
scripts/gpu_ab.sh) on synthetic benchmark results, and the -D flags benchmarks/tune_kernels.py
compiles a variant with."""

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = "hdim causal N      kind  variant                 ms   TFLOP/s    maxdiff\n"


def _tune_output(path, cells):
    """A tune_kernels.py output: cells = [(hdim, causal, N, tflops, maxdiff)] of one fwd90 variant."""
    lines = [HEADER, "some banner line the parser must skip\n"]
    for hdim, causal, n, tflops, maxdiff in cells:
        lines.append(f"{hdim:<4} {causal:<6} {n:<6} fwd   fwd90 BM=128 BN=128   0.100   {tflops:7.1f}   {maxdiff}\n")
    path.write_text("".join(lines))
    return str(path)


def test_compare_tune_ratios_summary_and_maxdiff_flag(tmp_path):
    old = [_tune_output(tmp_path / f"old{r}.txt", [(128, "no", 1024, 400.0 + r, "0"), (128, "no", 4096, 600.0, "0")])
           for r in (1, 2)]  # old means: 401.5 and 600
    new = [_tune_output(tmp_path / f"new{r}.txt", [(128, "no", 1024, 440.0 + 2 * r, "0"), (128, "no", 4096, 540.0, "0.5")])
           for r in (1, 2)]  # new means: 443 and 540
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "compare_tune.py"), "--old", ",".join(old),
                        "--new", ",".join(new)], capture_output=True, text=True, check=True)
    out = r.stdout
    assert f"{443 / 401.5:.3f}" in out and f"{540 / 600:.3f}" in out
    assert f"hd128  N<=2k: {443 / 401.5:.3f} over 1 cells" in out
    assert f"hd128  N>=4k: {540 / 600:.3f} over 1 cells" in out
    assert "maxdiff 0 -> 0.5" in out  # the new tree computes something else there: flagged
    assert f"min {540 / 600:.3f}" in out and f"max {443 / 401.5:.3f}" in out


def test_compare_tune_reads_the_sustained_medians(tmp_path):
    # tune_kernels --sustain prints per-round lines and a clock line per variant beside its median
    # line in the short timing's format: only the medians are cells.
    def sustained(path, median, rounds):
        lines = [HEADER]
        lines += [f"round {r}: 64 no 8192 fwd fwd90 BM=192 BN=128  0.100 ms {x:.1f} TFLOP/s 1750 MHz 690 W\n"
                  for r, x in enumerate(rounds)]
        lines.append(f"64   no     8192   fwd   fwd90 BM=192 BN=128   0.100   {median:7.1f}   0\n")
        lines.append(f"  clock (median of {len(rounds)} rounds): 1750 MHz, 690 W, {median / 1.75:.1f} TFLOP/s per GHz\n")
        path.write_text("".join(lines))
        return str(path)

    old = sustained(tmp_path / "old.txt", 500.0, [480.0, 500.0, 990.0])
    new = sustained(tmp_path / "new.txt", 525.0, [1.0, 525.0, 530.0])
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "compare_tune.py"), "--old", old, "--new", new],
                       capture_output=True, text=True, check=True)
    assert "over 1 cells" in r.stdout and f"median {525 / 500:.3f}" in r.stdout


def _decode_output(path, cells):
    """A tune_kernels.py split-KV output: cells = [(case, splits, tbps, maxdiff)] of one variant."""
    lines = ["case             variant                       splits        ms    TB/s  split_ms   comb_ms   maxdiff\n"]
    for case, splits, tbps, maxdiff in cells:
        lines.append(f"{case:16} BN=64 w=4 st=2 minB=3 qr=0 ef=1 tma=1   {splits:>6}    0.0200   {tbps:.3f}"
                     f"    0.0170    0.0030  {maxdiff}\n")
    lines.append("summary (TB/s): heuristic(splits) / best(splits)\n")
    # The per-case lines after the summary, as the binary prints them (the parser must skip them).
    for case, splits, tbps, _ in cells:
        lines.append(f"  {case:16} splits {splits.rstrip('h'):>3}  total   0.0200  split   0.0170  combine  0.0030"
                     f"  {tbps:.2f} TB/s\n")
    path.write_text("".join(lines))
    return str(path)


def test_compare_tune_decode_cells(tmp_path):
    old = [_decode_output(tmp_path / f"old{r}.txt", [("B1xN8192", "16h", 1.6 + 0.02 * r, "0"),
                                                      ("B64xN32768xP16", "3h", 4.0, "0")]) for r in (1, 2)]
    new = [_decode_output(tmp_path / f"new{r}.txt", [("B1xN8192", "16h", 2.0, "0"),
                                                      ("B64xN32768xP16", "3h", 4.4, "0.001")]) for r in (1, 2)]
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "compare_tune.py"), "--old", ",".join(old),
                        "--new", ",".join(new)], capture_output=True, text=True, check=True)
    out = r.stdout
    assert "B1xN8192" in out and "B64xN32768xP16" in out and "16h" in out
    assert f"{2.0 / 1.63:.3f}" in out and f"{4.4 / 4.0:.3f}" in out
    assert "maxdiff 0 -> 0.001" in out
    assert "over 2 cells" in out and "all 2 cells" in out


def test_compare_tune_without_common_cells_fails(tmp_path):
    old = _tune_output(tmp_path / "old.txt", [(64, "no", 1024, 300.0, "0")])
    new = _tune_output(tmp_path / "new.txt", [(128, "no", 1024, 300.0, "0")])
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "compare_tune.py"), "--old", old, "--new", new],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "no cell common" in r.stderr


RESULTS_HEADER = "dtype,hdim,causal,max_len,mode,impl,status,tflops,seqlen\n"


def _bench_results(path, rows):
    """A benchmark results.csv: rows = [(hdim, mode, impl, tflops, seqlen)]; varlen rows have no
    seqlen (empty), as the benchmark writes them, and max_len 1024."""
    path.mkdir()
    lines = [RESULTS_HEADER] + [f"bf16,{h},False,1024,{mode},{impl},ok,{tf},{'' if n is None else n}\n"
                                for h, mode, impl, tf, n in rows]
    (path / "results.csv").write_text("".join(lines))
    return str(path)


def _compare_runs(old, new, peer=None):
    return subprocess.run([sys.executable, os.path.join(REPO, "scripts", "compare_runs.py"), "--old", old,
                           "--new", new] + (["--peer", peer] if peer else []), capture_output=True, text=True)


def test_compare_runs_keys_varlen_rows_by_their_longest_sequence(tmp_path):
    """Varlen rows (no seqlen) and the dense comparison row of the same mode are compared, not dropped."""
    old = _bench_results(tmp_path / "old", [(64, "fwd", "flash_attn_ext", 400.0, 4096),
                                            (64, "varlen_fwd", "flash_attn_ext", 200.0, None),
                                            (64, "varlen_fwd", "flash_attn_ext-dense", 300.0, 1024)])
    new = _bench_results(tmp_path / "new", [(64, "fwd", "flash_attn_ext", 440.0, 4096),
                                            (64, "varlen_fwd", "flash_attn_ext", 230.0, None),
                                            (64, "varlen_fwd", "flash_attn_ext-dense", 330.0, 1024)])
    r = _compare_runs(old, new, peer="flash_attn_ext-dense")
    assert r.returncode == 0, r.stderr
    assert "varlen_fwd" in r.stdout and f"{230 / 200:.3f}" in r.stdout and f"{330 / 300:.3f}" in r.stdout
    assert "over 2 cases" in r.stdout


def test_compare_runs_keys_decode_rows_by_batch_cache_and_page(tmp_path):
    """Decode rows (TB/s, no seqlen or TFLOP/s) are compared per (batch, cache length, page size)."""
    header = "dtype,hdim,causal,mode,impl,status,tflops,tbps,seqlen,batch,seqlen_k,page_size\n"

    def results(path, rows):  # rows = [(batch, page_size, TB/s)] of ours, plus one dense row
        path.mkdir()
        lines = [header, "bf16,128,False,fwd,flash_attn_ext,ok,600.0,,4096,,,\n"]
        lines += [f"bf16,128,,decode,flash_attn_ext,ok,,{tb},,{b},8192,{p}\n" for b, p, tb in rows]
        (path / "results.csv").write_text("".join(lines))
        return str(path)

    old = results(tmp_path / "old", [(64, 0, 4.0), (64, 16, 3.0), (1, 0, 2.0)])
    new = results(tmp_path / "new", [(64, 0, 4.4), (64, 16, 3.0), (1, 0, 1.0)])
    r = _compare_runs(old, new)
    assert r.returncode == 0, r.stderr
    assert "B64 Nk8192 page0" in r.stdout and "B64 Nk8192 page16" in r.stdout and "B1 Nk8192 page0" in r.stdout
    assert "over 4 cases: min 0.500, median 1.000, max 1.100" in r.stdout


@pytest.mark.parametrize("column, old_rows, new_rows, case", [
    ("timing", [("eager", 1.0), ("graph", 2.0)], [("eager", 1.5), ("graph", 2.0)], "B1 Nk8192 page0 graph"),
    ("fill", [("1.0", 2.0), ("0.5", 1.0)], [("", 2.0), ("0.5", 1.5)], "B1 Nk8192 page0 fill0.5"),
])
def test_compare_runs_keeps_graph_and_ragged_decode_apart(tmp_path, column, old_rows, new_rows, case):
    """Decode rows timed as CUDA graph replays (timing graph) are other cases than eager ones, and
    rows of a ragged cache (--decode-fill < 1) other cases than full-cache ones (fill 1.0, or empty:
    runs before the flag)."""
    header = f"dtype,hdim,causal,mode,impl,status,tflops,tbps,seqlen,batch,seqlen_k,page_size,{column}\n"

    def results(path, rows):  # rows = [(timing or fill, TB/s)] of ours at B1 Nk8192 contiguous
        path.mkdir()
        lines = [header] + [f"bf16,128,,decode,flash_attn_ext,ok,,{tb},,1,8192,0,{x}\n" for x, tb in rows]
        (path / "results.csv").write_text("".join(lines))
        return str(path)

    r = _compare_runs(results(tmp_path / "old", old_rows), results(tmp_path / "new", new_rows))
    assert r.returncode == 0, r.stderr
    assert case in r.stdout and "over 2 cases: min 1.000, median 1.250, max 1.500" in r.stdout


def test_compare_runs_counts_only_cases_of_both_sides(tmp_path):
    """The summary line counts the cases measured on both sides and names the rest; dense rows
    (causal True / False) beside decode rows ("-") sort without pandas' unorderable warning."""
    header = "dtype,hdim,causal,mode,impl,status,tflops,tbps,seqlen,batch,seqlen_k,page_size\n"
    dense = "bf16,128,True,fwd,flash_attn_ext,ok,{},,4096,,,\n"
    for side, tf, extra in (("old", 500.0, ["bf16,128,,decode,flash_attn_ext,ok,,2.0,,1,8192,0\n"]),
                            ("new", 550.0, ["bf16,128,False,fwd,flash_attn_ext,ok,300.0,,1024,,,\n"])):
        (tmp_path / side).mkdir()
        (tmp_path / side / "results.csv").write_text("".join([header, dense.format(tf)] + extra))
    r = _compare_runs(str(tmp_path / "old"), str(tmp_path / "new"))
    assert r.returncode == 0, r.stderr
    assert "over 1 cases (2 more measured on one side only): min 1.100" in r.stdout, r.stdout
    assert "RuntimeWarning" not in r.stderr, r.stderr


def test_splitkv_sweep_smoke():
    """scripts/splitkv_sweep.sh runs end to end on the CPU (eager timing): one line per (round, fill,
    split count, balance knob) with every case's TB/s of ours."""
    env = dict(os.environ, CASES="B1xN64,B2xN48", SPLITS="h", FILLS="1 0.5", BALANCE="1 0", ROUNDS="1", GRAPH="", REP_MS="1",
               WARMUP_MS="1", EXTRA="--decode-hdim 32 --decode-heads 4:2 --device cpu", PYTHON=sys.executable)
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "splitkv_sweep.sh")], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["R1 F1 S=h bal=1", "R1 F1 S=h bal=0", "R1 F0.5 S=h bal=1",
                                                 "R1 F0.5 S=h bal=0"], r.stdout
    assert all(re.search(r"B1x64=[0-9.]+ B2x48=[0-9.]+$", ln) for ln in lines), r.stdout


def test_compare_runs_without_common_cases_fails(tmp_path):
    old = _bench_results(tmp_path / "old", [(64, "fwd", "flash_attn_ext", 400.0, 4096)])
    new = _bench_results(tmp_path / "new", [(128, "fwd", "flash_attn_ext", 440.0, 4096)])
    r = _compare_runs(old, new)
    assert r.returncode != 0 and "no case" in r.stderr


def _tune_kernels():
    """benchmarks/tune_kernels.py as a module (its main() only runs as a script)."""
    import importlib.util
    path = os.path.join(REPO, "benchmarks", "tune_kernels.py")
    spec = importlib.util.spec_from_file_location("tune_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _issue_bars():
    """scripts/issue_bars.py as a module."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    try:
        import issue_bars
    finally:
        sys.path.pop(0)
    return issue_bars


def _issue_bars_table(path, header, rows):
    """issue_bars' table of one synthetic run (results.csv of ``header`` and ``rows``, written in
    ``path``), indexed by cell."""
    path.mkdir()
    (path / "results.csv").write_text(header + "\n".join(rows) + "\n")
    issue_bars = _issue_bars()
    df, _ = issue_bars.load([str(path)])
    return issue_bars.bars(df).set_index("cell")


def test_issue_bars_verdicts(tmp_path):
    """scripts/issue_bars.py: each issue's cells against its peer or bar, decode per timing, paged
    against contiguous, a run's median over repeated rows, and the cells no run measured."""
    header = "dtype,hdim,causal,mode,impl,status,tflops,tbps,seqlen,batch,seqlen_k,page_size,timing\n"
    rows = [
        "bf16,64,False,fwd,flash_attn_ext,ok,510,,4096,,,,",       # / FA4 500: PASS
        "bf16,64,False,fwd,flash-attn4,ok,500,,4096,,,,",
        "bf16,64,False,fwd,sdpa-cudnn,ok,520,,4096,,,,",            # / cuDNN 520: FAIL (0.981)
        "bf16,128,True,fwd,flash_attn_ext,ok,600,,8192,,,,",        # median of 600 and 640 = 620
        "bf16,128,True,fwd,flash_attn_ext,ok,640,,8192,,,,",
        "bf16,128,True,fwd,flash-attn4,ok,630,,8192,,,,",           # 620 / 630: FAIL
        "bf16,128,True,fwd,flash-attn4,OOM,10,,8192,,,,",           # not ok: ignored
        "bf16,128,,decode,flash_attn_ext,ok,,2.05,,1,8192,0,graph",  # >= 2.0: PASS
        "bf16,128,,decode,flash_attn_ext,ok,,1.70,,1,8192,,eager",   # empty page size = contiguous: FAIL
        "bf16,128,,decode,flash_attn_ext,ok,,4.00,,1,131072,0,eager",   # >= 3.9: PASS
        "bf16,128,,decode,flash_attn_ext,ok,,3.50,,1,131072,16,eager",  # 0.875 of contiguous: FAIL
        "bf16,128,,decode,flash_attn_ext,ok,,3.80,,1,131072,64,eager",  # 0.95: PASS
        "bf16,64,False,bwd,flash_attn_ext,ok,421,,8192,,,,",        # >= 420: PASS
        "bf16,96,True,bwd,flash_attn_ext,ok,380,,8192,,,,",
        "bf16,96,True,bwd,sdpa-cudnn,ok,400,,8192,,,,",             # 0.95: FAIL
    ]
    table = _issue_bars_table(tmp_path / "run", header, rows)
    verdict = table["verdict"].to_dict()
    assert verdict["fwd bf16 hd64 N=4096 / flash-attn4"] == "PASS"
    assert verdict["fwd bf16 hd64 N=4096 / sdpa-cudnn"] == "FAIL"
    assert verdict["fwd bf16 hd128 causal N=8192 / flash-attn4"] == "FAIL"
    assert table.loc["fwd bf16 hd128 causal N=8192 / flash-attn4", "ours"] == "620.00"
    assert verdict["fwd bf16 hd128 N=16384 / flash-attn4"] == "not measured"
    assert verdict["decode graph B1 Nk=8192"] == "PASS" and verdict["decode eager B1 Nk=8192"] == "FAIL"
    assert verdict["decode eager B1 Nk=131072 page 16 / contiguous"] == "FAIL"
    assert verdict["decode eager B1 Nk=131072 page 64 / contiguous"] == "PASS"
    assert verdict["decode eager B1 Nk=131072 page 256 / contiguous"] == "not measured"
    assert verdict["decode eager B1 Nk=131072"] == "PASS" and verdict["decode eager B8 Nk=32768"] == "not measured"
    assert verdict["bwd bf16 hd64 N=8192"] == "PASS" and verdict["bwd bf16 hd128 N=8192"] == "not measured"
    assert verdict["bwd bf16 hd96 causal N=8192 / sdpa-cudnn"] == "FAIL"
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "issue_bars.py"), str(tmp_path / "run")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "issue 14: 3 of 5 measured cells pass" in r.stdout and "issue 13: 1 of 3" in r.stdout, r.stdout


def test_issue_bars_decode_only_run(tmp_path):
    """A run of --mode decode alone (its results.csv has no dense columns: no seqlen, no causal)
    gives issue 14's cells and leaves the dense ones not measured (it raised KeyError 'seqlen')."""
    header = "dtype,hdim,gqa,nheads,nheads_k,batch,seqlen_k,page_size,mode,timing,fill,impl,status,tbps\n"
    rows = ["bf16,128,4,32,8,1,8192,0,decode,graph,1.0,flash_attn_ext,ok,2.10",
            "bf16,128,4,32,8,1,8192,16,decode,graph,1.0,flash_attn_ext,ok,1.80"]
    table = _issue_bars_table(tmp_path / "run", header, rows)
    verdict = table["verdict"].to_dict()
    assert verdict["decode graph B1 Nk=8192"] == "PASS"
    assert verdict["fwd bf16 hd64 N=4096 / flash-attn4"] == "not measured"
    assert verdict["bwd bf16 hd64 N=8192"] == "not measured"
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "issue_bars.py"), str(tmp_path / "run")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "issue 14: 1 of 1 measured cells pass" in r.stdout, r.stdout


def test_issue_bars_failures_and_decode_dtype(tmp_path):
    """Ours failing a cell (error / OOM) is FAIL, not "not measured"; a failed contiguous row leaves
    its paged ratios not measured; decode cells are the issue's bf16 (an fp32 row of the same case
    was pooled into the median); a peer's failure still leaves its cells not measured."""
    header = "dtype,hdim,gqa,nheads,nheads_k,batch,seqlen_k,page_size,mode,timing,fill,impl,status,tbps\n"
    rows = ["bf16,128,4,32,8,1,8192,0,decode,graph,1.0,flash_attn_ext,ok,2.10",
            "fp32,128,4,32,8,1,8192,0,decode,graph,1.0,flash_attn_ext,ok,0.10",
            "bf16,128,4,32,8,1,131072,0,decode,graph,1.0,flash_attn_ext,error,",
            "bf16,128,4,32,8,1,131072,16,decode,graph,1.0,flash_attn_ext,ok,3.80",
            "bf16,128,4,32,8,8,32768,0,decode,graph,1.0,flash_attn_ext,OOM,",
            "bf16,128,4,32,8,64,8192,0,decode,graph,1.0,flash_attn_ext,n/a,"]
    table = _issue_bars_table(tmp_path / "run", header, rows)
    verdict = table["verdict"].to_dict()
    assert verdict["decode graph B1 Nk=8192"] == "PASS" and table.loc["decode graph B1 Nk=8192", "ours"] == "2.10"
    assert verdict["decode graph B1 Nk=131072"].startswith("FAIL (ours")
    assert verdict["decode graph B8 Nk=32768"].startswith("FAIL (ours")
    assert verdict["decode graph B64 Nk=8192"] == "not measured"  # n/a: e.g. a head dim outside the build
    assert verdict["decode graph B1 Nk=131072 page 16 / contiguous"] == "not measured"
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "issue_bars.py"), str(tmp_path / "run")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "issue 14: 1 of 3 measured cells pass" in r.stdout, r.stdout


def test_tune_variant_defines_fill_sm90_backward_defaults():
    """dkv90 / dq90 variants get every optional template argument (split 1, roles 0, tma 1, stages 2,
    dkv90's diet 0, dq90's min CTAs / SM 1) as a -D flag, the given ones kept; sm80 kinds keep their
    own defaults in the .cu file; too many arguments is an error naming the kind."""
    tk = _tune_kernels()
    dkv = tk.variant_defines("dkv90:256:64,64,1,1")
    assert dkv[-7:] == ["-DA1=64", "-DA2=64", "-DA3=1", "-DA4=1", "-DA5=1", "-DA6=2", "-DA7=0"] and "-DTUNE_SM90" in dkv
    assert tk.variant_defines("dkv90:96:64,192,1,0,1,2,3")[-1] == "-DA7=3"  # d96's long row: DpInS + PSmem
    assert tk.variant_defines("dq90:128:128,64")[-6:] == ["-DA1=128", "-DA2=64", "-DA3=0", "-DA4=1", "-DA5=2",
                                                          "-DA6=1"]
    assert tk.variant_defines("dq90:256:64,64,1,0")[-4:] == ["-DA3=1", "-DA4=0", "-DA5=2", "-DA6=1"]
    assert tk.variant_defines("dq90:128:128,64,0,1,3")[-2] == "-DA5=3"
    assert tk.variant_defines("dq90:64:64,64,0,1,2,3")[-1] == "-DA6=3"  # d64's production min CTAs / SM
    assert tk.variant_defines("dkv:128:64,128,1")[-1] == "-DA3=1"  # nothing appended
    with pytest.raises(SystemExit, match="dkv90 takes 2 to 7"):
        tk.variant_defines("dkv90:256:64,64,1,1,1,3,1,0")


def test_gpu_ab_tune_prebuilt_sides(tmp_path):
    """scripts/gpu_ab_tune.sh with PREBUILT binaries (built elsewhere, carried to the GPU machine):
    no compile, the sides run alternately ROUNDS times, every side compared with the first. Fake
    binaries print synthetic tune_kernels.py outputs (the side's TFLOP/s plus the round's offset)."""
    speeds = {"old": 400.0, "new": 440.0, "other": 380.0}
    for side, tflops in speeds.items():
        d = tmp_path / "bins" / side
        d.mkdir(parents=True)
        body = (f"#!/bin/sh\nn=$(cat {d}/n 2>/dev/null || echo 0); echo $((n + 1)) > {d}/n\n"
                f"printf '%s' '{HEADER}'\n"
                f"printf '128  no     1024   fwd   fwd90 BM=128 BN=128   0.100   %s   0\\n' $(({int(tflops)} + 2 * n))\n")
        (d / "tune_kernels").write_text(body)
        (d / "tune_kernels").chmod(0o755)
    env = dict(os.environ, PREBUILT=str(tmp_path / "bins"), SIDES="old new other", ROUNDS="2",
               AB_WORK=str(tmp_path / "work"))
    env.pop("OUT", None)
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu_ab_tune.sh")], capture_output=True, text=True,
                       env=env, check=True)
    assert "=== new / old" in r.stdout and "=== other / old" in r.stdout
    # Means over rounds 0 and 1 (+0 and +2): old 401, new 441, other 381.
    assert f"{441 / 401:.3f}" in r.stdout and f"{381 / 401:.3f}" in r.stdout
    for side in speeds:
        assert (tmp_path / "bins" / side / "n").read_text().strip() == "2"  # ROUNDS runs of each side
    assert (tmp_path / "work" / "compare.txt").exists() and (tmp_path / "work" / "compare_other.txt").exists()


def test_varlen_idle_ctas_smoke(capsys):
    """scripts/varlen_idle_ctas.py runs end to end on the CPU (its numbers mean something on a GPU
    only): one row per (hdim, causal, pass), the ratio of the two max_seqlen calls."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("varlen_idle_ctas", os.path.join(REPO, "scripts", "varlen_idle_ctas.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--device", "cpu", "--tokens", "64", "--seqs", "4", "--lens", "8,32", "--hdim", "16", "--reps", "1",
                 "--factor", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 16 |")]
    assert len(rows) == 4 and all(float(r.split("|")[-2]) > 0 for r in rows), rows


def test_long_keys_diag_smoke(capsys):
    """scripts/long_keys_diag.py (the GPU backward-past-2^31 diagnosis) runs end to end on the CPU op
    with short keys (and the long-query case with short queries): every case's header and verdicts,
    and the CPU op meets the rule in each."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("long_keys_diag", os.path.join(REPO, "scripts", "long_keys_diag.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--device", "cpu", "--seqlen-k", "2048", "--seqlen-q", "1024",
                 "--cases", "test,early,equal,flat,longq"])
    out = capsys.readouterr().out
    for case in ("test", "early", "equal", "flat"):
        assert f"== {case}: seqlen_k 2048" in out, out
    assert "== longq: seqlen_q 1024, seqlen_k 1024" in out, out
    verdicts = [line for line in out.splitlines() if line.rstrip().endswith(("ok", "FAILS the rule"))]
    assert len(verdicts) == 19 and all(v.rstrip().endswith("ok") for v in verdicts), out


def test_window_bench_smoke(capsys):
    """scripts/window_bench.py runs end to end on the CPU: a row per (window, pass), the window's
    pair count (its FLOP basis) checked against a brute-force count of the reference mask."""
    import importlib.util

    from flash_attn_ext.reference import visible_mask

    spec = importlib.util.spec_from_file_location("window_bench", os.path.join(REPO, "scripts", "window_bench.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for n, w in [(50, 0), (50, 7), (50, 50), (50, 80), (7, 3)]:
        want = int(visible_mask(n, n, True, w - 1 if w > 0 else -1, -1).sum())
        assert script.visible_pairs(n, w) == want, (n, w)
    script.main(["--device", "cpu", "--seqlen", "64", "--window", "8", "--hdim", "16", "--tokens", "64", "--rep-ms", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 16 |")]
    assert len(rows) == 4 and all(float(r.split("|")[6]) > 0 for r in rows), rows


def test_hf_bench_smoke(capsys):
    """scripts/hf_bench.py runs end to end on the CPU: a train-step and a forward row per (layout,
    implementation), ours with its speed over sdpa's."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_bench", os.path.join(REPO, "scripts", "hf_bench.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.lengths(4, 32) == [8, 16, 24, 32] and script.lengths(1, 32) == [32]
    script.main(["--device", "cpu", "--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                 "--batch", "2", "--seqlen", "16", "--rep-ms", "1"])
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    ours = [r for r in rows if r[2].strip() == "fa_ext"]
    assert len(rows) == 16 and len(ours) == 8 and all(float(r[6]) > 0 for r in ours), rows


def test_sinks_bench_smoke(capsys):
    """scripts/sinks_bench.py runs end to end on the CPU: one row per (hdim, seqlen, causal, pass)
    and per decode case, positive times both ways."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sinks_bench", os.path.join(REPO, "scripts", "sinks_bench.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script._cases("B1xN8192,b64xn512") == [(1, 8192), (64, 512)]
    script.main(["--device", "cpu", "--seqlen", "64", "--hdim", "16", "--tokens", "64", "--decode", "B2xN128",
                 "--rounds", "1", "--rep-ms", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| d16 ") or "decode" in line]
    assert len(rows) == 5, rows
    assert all(float(r.split("|")[2]) > 0 and float(r.split("|")[3]) > 0 for r in rows), rows


@pytest.mark.parametrize("script, rows_expected", [("softcap_bench", 4), ("dropout_bench", 2), ("alibi_bench", 4)])
def test_feature_cost_bench_smoke(script, rows_expected, capsys):
    """scripts/softcap_bench.py, alibi_bench.py and dropout_bench.py run end to end on the CPU: one row per (hdim,
    seqlen, causal[, mode]), positive TFLOP/s with and without the feature (no GPU peer on the CPU)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(script, os.path.join(REPO, "scripts", f"{script}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--device", "cpu", "--seqlen", "64", "--hdim", "16", "--tokens", "64", "--rounds", "1",
                 "--rep-ms", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| d16 ")]
    assert len(rows) == rows_expected, rows
    assert all(float(r.split("|")[2]) > 0 and float(r.split("|")[3]) > 0 for r in rows), rows


def test_varlen_walk_model_rows():
    """scripts/varlen_walk_model.py: one row per (hdim, causal) tile row, each order's makespan at
    least the ideal (the total cost spread evenly over the CTAs), on a small batch."""
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "varlen_walk_model.py"), "--seqs", "12",
                        "--tokens", "3000", "--lens", "64,512", "--seeds", "2", "--ctas", "16"],
                       capture_output=True, text=True, check=True, cwd=REPO)
    rows = [line.split() for line in r.stdout.splitlines()[1:]]
    assert [(row[0], row[1]) for row in rows] == [(h, c) for h in ("64", "128", "256") for c in ("False", "True")]
    for row in rows:
        assert all(float(x) >= 1.0 - 1e-9 for x in row[2:]), row


def test_clocks_by_impl_joins_each_timing_window(tmp_path):
    """scripts/clocks_by_impl.py: each result row takes the clock samples inside its timing window
    (or the nearest within 0.5 s), per implementation and per case against a peer."""
    import pandas as pd

    bench = tmp_path / "bench"
    bench.mkdir()
    # ours timed 10:00:00-10:00:01 (samples 1800 MHz / 690 W), the peer 10:00:02-10:00:03 (1980 / 600),
    # a second case whose peer window holds no sample (the nearest, 10:00:05.000, is 0.05 s from its middle)
    rows = [("flash_attn_ext", 4096, "10:00:00.000000", "10:00:01.000000", 1.0),
            ("flash-attn4", 4096, "10:00:02.000000", "10:00:03.000000", 1.1),
            ("flash_attn_ext", 8192, "10:00:04.000000", "10:00:04.900000", 1.0),
            ("flash-attn4", 8192, "10:00:04.910000", "10:00:04.990000", 1.0),
            ("sdpa-cudnn", 8192, "", "", 1.0)]  # a row that was not measured
    pd.DataFrame([{"dtype": "bf16", "hdim": 128, "causal": False, "seqlen": n, "mode": "fwd", "impl": impl,
                   "ms": ms, "timed_from": f"2026/12/04 {a}" if a else "", "timed_to": f"2026/12/04 {b}" if b else ""}
                  for impl, n, a, b, ms in rows]).to_csv(bench / "results.csv", index=False)
    samples = [("09:59:59.800", 345, 80), ("10:00:00.200", 1800, 690), ("10:00:00.400", 1800, 690),
               ("10:00:00.600", 1790, 700), ("10:00:02.200", 1980, 600), ("10:00:02.400", 1980, 600),
               ("10:00:04.200", 1700, 650), ("10:00:05.000", 1950, 610)]
    (tmp_path / "clocks.csv").write_text("".join(f"2026/12/04 {t}, {m}, {w}.00, 40\n" for t, m, w in samples))
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "clocks_by_impl.py"), str(bench),
                          str(tmp_path / "clocks.csv"), "--peer", "flash-attn4"],
                         capture_output=True, text=True, check=True).stdout
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    try:
        import clocks_by_impl as c
    finally:
        sys.path.pop(0)
    joined = c.join(pd.read_csv(bench / "results.csv", keep_default_na=False, na_values=[""]),
                    c.read_clocks(tmp_path / "clocks.csv"))
    got = {(r.impl, r.seqlen): (r.mhz, r.watts) for r in joined.itertuples()}
    assert got[("flash_attn_ext", 4096)] == (1800, pytest.approx(2080 / 3))
    assert got[("flash-attn4", 4096)] == (1980, 600)
    assert got[("flash_attn_ext", 8192)] == (1700, 650)
    assert got[("flash-attn4", 8192)] == (1950, 610)  # nearest sample to the window's middle
    assert ("sdpa-cudnn", 8192) not in got
    assert "median SM MHz" in out and "ours against flash-attn4" in out
    ratio = c.versus(joined, "flash-attn4")["mhz ratio"].tolist()
    assert ratio == pytest.approx([1800 / 1980, 1700 / 1950], abs=1e-3)


def test_sass_stats_turns_and_loops():
    """scripts/sass_stats.py on a synthetic instruction list: the turn section between BAR.SYNC and
    BAR.ARV (not a BAR.SYNC ... BAR.SYNC stretch), and a backward branch's body with its HGMMA."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    try:
        import sass_stats
    finally:
        sys.path.pop(0)
    text = ["BAR.SYNC.DEFER_BLOCKING R7, 0x100", "UIADD3 UR4, UR5, 0x1, URZ", "BAR.SYNC R8, 0x100",
            "WARPGROUP.ARRIVE", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], RZ, !UPT",
            "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], R24", "BAR.ARV R9, 0x100", "FMNMX R1, R2, R3, !PT",
            "HGMMA.64x64x16.F32.BF16 R88, R120, gdesc[UR8].tnspB, R88",
            "HGMMA.64x64x16.F32.BF16 R88, R124, gdesc[UR8].tnspB, R88, gsb0", "@!P0 BRA 0x30", "EXIT"]
    ins = [(16 * k, s) for k, s in enumerate(text)]
    assert sass_stats.opcode("@!P0 BRA 0x30") == "BRA" and sass_stats.opcode("HGMMA.64x64x16.F32 R1") == "HGMMA"
    (i, body), = sass_stats.turns(ins)
    assert i == 2 and [sass_stats.opcode(x) for x in body] == ["WARPGROUP", "HGMMA", "HGMMA"]
    assert sass_stats.mix(body) == "HGMMA:2 WARPGROUP:1"
    (first, last, body), = sass_stats.loops(ins)
    assert (first, last) == (3, 10) and len(body) == 8
    assert sass_stats.loops(ins, min_hgmma=5) == []


@pytest.mark.parametrize("script", sorted(
    os.path.relpath(p, REPO) for d in ("scripts", "examples", "benchmarks")
    for p in __import__("glob").glob(os.path.join(REPO, d, "*.py"))))
def test_every_script_answers_help(script, tmp_path):
    """`python <script> --help` prints its usage and exits 0 on a machine without a GPU, writing
    nothing (examples/pack_minilm.py once wrote a model into a folder named --help; others crashed
    on a missing triton, a CUDA call or their own argv parsing)."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, os.path.join(REPO, script), "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower()
    assert os.listdir(tmp_path) == []


def test_issue_bars_anchor_device_and_accuracy(tmp_path):
    """issue_bars counts only the issues' configuration (a GQA row or another token count does not
    pool into the cell: a reviewer's synthetic run turned 500 / 550 into a PASS that way), marks a
    cell WRONG where ours' error is above 2x standard attention's, and refuses runs of two GPUs."""
    header = "dtype,hdim,causal,gqa,mode,impl,status,tflops,seqlen,batch,nheads,nheads_k,err\n"
    rows = [
        "bf16,64,False,1,fwd,flash_attn_ext,ok,500,4096,4,32,32,0.001",
        "bf16,64,False,1,fwd,flash-attn4,ok,550,4096,4,32,32,0.001",
        "bf16,64,False,4,fwd,flash_attn_ext,ok,700,4096,4,32,8,0.001",     # GQA: not the issue's cell
        "bf16,64,False,1,fwd,flash_attn_ext,ok,900,4096,2,32,32,0.001",    # 8k tokens: likewise
        "bf16,128,False,1,fwd,flash_attn_ext,ok,700,8192,2,16,16,0.5",     # fast but wrong
        "bf16,128,False,1,fwd,flash-attn4,ok,650,8192,2,16,16,0.001",
        "bf16,128,False,1,fwd,standard,ok,100,8192,2,16,16,0.002",
    ]
    issue_bars = _issue_bars()
    for name, device in (("a", "NVIDIA H200"), ("b", "NVIDIA H100 80GB HBM3")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.csv").write_text(header + "\n".join(rows) + "\n")
        (tmp_path / name / "results.json").write_text(json.dumps({"environment": {"device_name": device}}))
    df, _ = issue_bars.load([str(tmp_path / "a")])
    verdict = issue_bars.bars(df).set_index("cell")["verdict"].to_dict()
    assert verdict["fwd bf16 hd64 N=4096 / flash-attn4"] == "FAIL"          # 500 / 550, the GQA row left out
    assert verdict["fwd bf16 hd128 N=8192 / flash-attn4"].startswith("WRONG")
    assert issue_bars.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 2


def test_compare_runs_keeps_gqa_and_token_counts_apart(tmp_path):
    """Rows of one (dtype, hdim, causal, seqlen, mode) with another GQA ratio or batch are separate
    cases (they once pooled into one median, and the spread column showed the configurations'
    difference as noise)."""
    header = "dtype,hdim,causal,gqa,mode,impl,status,tflops,seqlen,batch\n"

    def results(path, speeds):
        path.mkdir()
        rows = [f"bf16,128,False,{g},fwd,flash_attn_ext,ok,{t},4096,{b}\n" for (g, b), t in speeds.items()]
        (path / "results.csv").write_text(header + "".join(rows))
        return str(path)

    old = results(tmp_path / "old", {(1, 4): 500.0, (4, 4): 700.0, (1, 2): 300.0})
    new = results(tmp_path / "new", {(1, 4): 550.0, (4, 4): 700.0, (1, 2): 300.0})
    r = _compare_runs(old, new)
    assert r.returncode == 0, r.stderr
    assert "over 3 cases: min 1.000, median 1.000, max 1.100" in r.stdout


def test_issue_bars_counts_only_full_cache_decode_rows(tmp_path):
    """Issue 14's cells are of a full cache: a --decode-fill < 1 run's rows (fewer bytes read, another
    problem) never pool into them, contiguous or paged; rows of runs before the fill column (or with
    it empty) count as full."""
    header = "dtype,hdim,gqa,nheads,nheads_k,mode,impl,status,tbps,batch,seqlen_k,page_size,timing,fill,seqlen\n"
    rows = [
        "bf16,128,4,32,8,decode,flash_attn_ext,ok,1.50,1,8192,0,eager,1.0",     # full: FAIL (< 2.0)
        "bf16,128,4,32,8,decode,flash_attn_ext,ok,9.00,1,8192,0,eager,0.5",     # ragged: left out
        "bf16,128,4,32,8,decode,flash_attn_ext,ok,9.00,1,8192,0,eager,0.5",
        "bf16,128,4,32,8,decode,flash_attn_ext,ok,4.00,64,32768,0,eager,1.0",   # contiguous, full
        "bf16,128,4,32,8,decode,flash_attn_ext,ok,3.00,64,32768,16,eager,1.0",  # 0.75: FAIL
        "bf16,128,4,32,8,decode,flash_attn_ext,ok,8.00,64,32768,16,eager,0.5",  # ragged: left out
        "bf16,128,4,32,8,decode,flash_attn_ext,ok,8.00,64,32768,16,eager,0.5",
        "bf16,128,4,32,8,decode,flash_attn_ext,ok,1.00,64,32768,64,eager,0.25",  # only ragged: not measured
        "bf16,128,4,32,8,decode,flash_attn_ext,ok,4.40,64,8192,0,eager,",        # empty fill: full, PASS
    ]
    table = _issue_bars_table(tmp_path / "run", header, rows)
    verdict = table["verdict"].to_dict()
    assert verdict["decode eager B1 Nk=8192"] == "FAIL" and table.loc["decode eager B1 Nk=8192", "ours"] == "1.50"
    assert verdict["decode eager B64 Nk=32768 page 16 / contiguous"] == "FAIL"
    assert table.loc["decode eager B64 Nk=32768 page 16 / contiguous", "ratio"] == "0.750"
    assert verdict["decode eager B64 Nk=32768 page 64 / contiguous"] == "not measured"
    assert verdict["decode eager B64 Nk=8192"] == "PASS"



def test_test_shards_partition_the_selection():
    """FLASH_ATTN_EXT_TEST_SHARD=i/n (tests/conftest.py; scripts/gpu_run.sh's SHARD): the shards of
    a selection are disjoint and together are the whole selection; a malformed value is a usage
    error naming the variable."""
    def collect(shard):
        env = {k: v for k, v in os.environ.items() if k != "FLASH_ATTN_EXT_TEST_SHARD"}
        if shard is not None:
            env["FLASH_ATTN_EXT_TEST_SHARD"] = shard
        return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               os.path.join("tests", "test_transforms.py")], env=env, cwd=REPO, capture_output=True,
                              text=True)

    def ids(r):
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return [line for line in r.stdout.splitlines() if "::" in line]

    whole = ids(collect(None))
    shards = [ids(collect(f"{i}/2")) for i in (1, 2)]
    assert len(whole) >= 4 and all(shards) and sorted(shards[0] + shards[1]) == sorted(whole)
    bad = collect("3/2")
    assert bad.returncode != 0 and "FLASH_ATTN_EXT_TEST_SHARD must be 'i/n'" in bad.stdout + bad.stderr


def test_gpu_only_selection_leaves_out_the_cpu_tests():
    """FLASH_ATTN_EXT_TEST_GPU_ONLY=1 (tests/conftest.py; scripts/gpu_run.sh's GPU_ONLY) leaves out
    exactly the CPU-only tests: those with a CPU ``device`` parameter or the word cpu in their name;
    0 leaves every test in; another value is a usage error naming the variable."""
    def collect(value):
        env = {k: v for k, v in os.environ.items()
               if k not in ("FLASH_ATTN_EXT_TEST_SHARD", "FLASH_ATTN_EXT_TEST_GPU_ONLY")}
        if value is not None:
            env["FLASH_ATTN_EXT_TEST_GPU_ONLY"] = value
        return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               os.path.join("tests", "test_transforms.py"), os.path.join("tests", "test_window.py")],
                              env=env, cwd=REPO, capture_output=True, text=True)

    def ids(r):
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return [line for line in r.stdout.splitlines() if "::" in line]

    whole, gpu = ids(collect(None)), ids(collect("1"))
    assert ids(collect("0")) == whole
    left_out = set(whole) - set(gpu)
    assert set(gpu) <= set(whole) and left_out
    by_param = {t for t in whole if re.search(r"[\[-]cpu[\]-]", t)}
    by_name = {t for t in whole if "cpu" in t.split("::")[1].split("[")[0].split("_")}
    assert by_param and by_name and left_out == by_param | by_name
    bad = collect("yes")
    assert bad.returncode != 0 and "FLASH_ATTN_EXT_TEST_GPU_ONLY must be 0 or 1" in bad.stdout + bad.stderr
