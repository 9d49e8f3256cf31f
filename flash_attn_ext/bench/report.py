"""Tables, files and plots of a sweep's rows; the one module that imports pandas and matplotlib
(lazily: the other modules run without them).

Files under --out: results.csv / results.json (one row per case and implementation, with status
'ok', 'n/a', 'OOM', 'skipped' or 'error' and a note; the JSON adds the environment), summary.csv
and summary.md (one row per case), tflops.png (TFLOP/s vs seqlen per config, every
implementation) and memory.png (peak extra memory vs seqlen, against standard attention).
ours/<peer>: flash_attn_ext TFLOP/s divided by the peer's TFLOP/s (> 1: flash_attn_ext is faster).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex

import torch

from flash_attn_ext.bench.peers import OURS, BenchmarkError
from flash_attn_ext.bench.timing import Timer, l2_bytes

CASE_KEYS = ["dtype", "hdim", "causal", "gqa", "seqlen", "batch", "nheads", "nheads_k", "mode"]
IMPL_STYLE = {OURS: dict(color="black", linewidth=2.5, marker="o")}


def require_deps():
    """BenchmarkError naming the missing ones of pandas, matplotlib, tqdm (the ``bench`` extra)."""
    missing = []
    for mod in ("pandas", "matplotlib", "tqdm"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise BenchmarkError(
            f"the benchmark needs {', '.join(missing)}: pip install 'flash_attn_ext[bench]' "
            f"(or pip install pandas matplotlib tqdm)")


def environment(device: torch.device, timer: Timer, argv: list[str]) -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": shlex.join(["python", "-m", "flash_attn_ext.benchmark", *argv]),
           "torch": torch.__version__, "python": platform.python_version(),
           "device": str(device), "timer": timer.method}
    try:
        import flash_attn_ext
        env["flash_attn_ext"] = getattr(flash_attn_ext, "__version__", "unknown")
    except Exception:
        pass
    if device.type == "cuda":
        prop = torch.cuda.get_device_properties(device)
        env.update(device_name=prop.name, sm=f"{prop.major}.{prop.minor}",
                   sm_count=prop.multi_processor_count, cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version(), l2_bytes=l2_bytes(device))
        try:
            import triton
            env["triton"] = triton.__version__
        except Exception:
            pass
    else:
        env.update(device_name=platform.processor() or platform.machine(),
                   cpu_threads=torch.get_num_threads())
    return env


def _pivot(df, values: str):
    """Case x implementation table of ``values`` (first value per cell, NaN where missing)."""
    return df.pivot_table(index=CASE_KEYS, columns="impl", values=values, aggfunc="first",
                          sort=False, dropna=False)


def _fmt(x, spec: str) -> str:
    """``x`` formatted with ``spec``; "" for NaN."""
    return format(x, spec) if x == x else ""


def add_ratios(df):
    """Column ``ours_over_peer`` = flash_attn_ext TFLOP/s / this row's TFLOP/s (same case)."""
    ours = df[df["impl"] == OURS].set_index(CASE_KEYS)["tflops"]
    keyed = df.set_index(CASE_KEYS)
    df = df.copy()
    df["ours_over_peer"] = (ours.reindex(keyed.index).to_numpy() / keyed["tflops"].to_numpy())
    return df


def summarize(df, impl_names: list[str]):
    """One row per case: TFLOP/s per implementation (or its status), ours/peer ratios, errors."""
    import pandas as pd

    cell = df["tflops"].map(lambda x: _fmt(x, ".3g"))
    cell = cell.where(df["status"] == "ok", df["status"])
    wide = df.assign(cell=cell).pivot_table(index=CASE_KEYS, columns="impl", values="cell",
                                            aggfunc="first", sort=False)
    num, errs = _pivot(df, "tflops"), _pivot(df, "err")
    out = pd.DataFrame(index=wide.index)
    for name in impl_names:
        out[f"{name} TFLOP/s"] = num[name] if name in num else float("nan")
    for name in impl_names[1:]:
        out[f"ours/{name}"] = num[OURS] / num[name] if name in num else float("nan")
    for name in impl_names:
        out[f"err {name}"] = errs[name] if name in errs else float("nan")
    return out.reset_index(), wide.reset_index()


def compact_table(df, impl_names: list[str], ratio_peers: list[str]):
    """The stdout table: case, TFLOP/s of each implementation that ran somewhere, ours/peer ratios
    for up to two peers, and the max error of flash_attn_ext and of standard attention."""
    import pandas as pd

    shown = [n for n in impl_names if (df[(df["impl"] == n)]["status"] != "n/a").any()]
    _, wide = summarize(df, impl_names)
    index = wide.set_index(CASE_KEYS).index
    num, errs = _pivot(df, "tflops").reindex(index), _pivot(df, "err").reindex(index)
    ratio_peers = [r for r in ratio_peers if r in shown and r != OURS and num[r].notna().any()]
    if not ratio_peers:
        ratio_peers = [n for n in shown if n != OURS and num[n].notna().any()][:2]
    t = pd.DataFrame({"dtype": wide["dtype"], "hdim": wide["hdim"],
                      "causal": wide["causal"].map(lambda c: "yes" if c else "no"),
                      "N": wide["seqlen"], "mode": wide["mode"]})
    if (wide["gqa"] != 1).any():
        t.insert(3, "gqa", wide["gqa"])
    t.insert(len(t.columns), "batch", wide["batch"])
    for n in shown:
        t[("ours" if n == OURS else n)] = wide[n].fillna("").to_numpy()
    for r in ratio_peers:
        t[f"ours/{r}"] = [_fmt(x, ".2f") for x in (num[OURS] / num[r]).to_numpy()]
    for n, label in ((OURS, "err ours"), ("standard", "err std")):
        if n in errs:
            t[label] = [_fmt(x, ".1e") for x in errs[n].to_numpy()]
    return t


def to_markdown(t) -> str:
    cols = [str(c) for c in t.columns]
    rows = [[str(x) for x in r] for r in t.itertuples(index=False)]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(cols), sep] + [line(r) for r in rows])


def device_label(env: dict) -> str:
    """The device as the summary header names it: the GPU's (or CPU's platform) name."""
    return env.get("device_name") or env["device"]


def plot_label(env: dict, batch: int | None, tokens: int | None, nheads: int | None) -> str:
    """What the plots ran on: the device (CPU: with its cores and threads), batch and heads."""
    device = device_label(env)
    if "cpu_threads" in env:
        threads = env["cpu_threads"]
        device = f"CPU {device} ({os.cpu_count()} cores, {threads} thread{'s' if threads != 1 else ''})"
    batch_text = f"batch {batch}" if batch is not None else f"batch = {tokens} tokens / seqlen"
    heads_text = f"{nheads} heads" if nheads is not None else "heads = 2048 / hdim"
    return f"{device}, {batch_text}, {heads_text}"


def header_text(env: dict) -> str:
    """The lines above the compact table (stdout and summary.md)."""
    return (f"flash_attn_ext benchmark on {device_label(env)} ({env['device']}), torch {env['torch']}; "
            f"timer: {env['timer']}.\nTFLOP/s by the standard count (fwd 4*B*H*N^2*d, halved "
            f"when causal; bwd 2.5x, fwd_bwd 3.5x); ours/<peer> = ratio of TFLOP/s (> 1: ours "
            f"faster); err = max |x - float64 reference| (out for fwd, max of dq/dk/dv "
            f"otherwise), batch 1 same seqlen.\nCommand: {env['command']}")


def plot(df, impl_names: list[str], out_dir: str, label: str) -> list[str]:
    """tflops.png and memory.png: one panel per (dtype, hdim, causal, gqa) x mode, titled
    "flash_attn_ext vs peers on <label>"."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    configs = list(dict.fromkeys(zip(df["dtype"], df["hdim"], df["causal"], df["gqa"])))
    modes = list(dict.fromkeys(df["mode"]))
    colors = plt.get_cmap("tab10")
    paths = []
    for metric, ylabel, fname, log in (("tflops", "TFLOP/s", "tflops.png", False),
                                       ("peak_mem_mib", "peak extra memory (MiB)", "memory.png", True)):
        fig, axes = plt.subplots(len(configs), len(modes), squeeze=False,
                                 figsize=(5.0 * len(modes), 3.4 * len(configs)))
        for r, (dtype, hdim, causal, gqa) in enumerate(configs):
            for c, mode in enumerate(modes):
                ax = axes[r][c]
                sel = df[(df["dtype"] == dtype) & (df["hdim"] == hdim) & (df["causal"] == causal)
                         & (df["gqa"] == gqa) & (df["mode"] == mode)]
                drawn = 0
                for i, name in enumerate(impl_names):
                    style = IMPL_STYLE.get(name, dict(color=colors(i % 10), linewidth=1.3, marker="."))
                    for x in sel[(sel["impl"] == name) & (sel["status"] == "OOM")]["seqlen"]:
                        ax.annotate(f"{name} OOM", xy=(x, 0.98), xycoords=("data", "axes fraction"),
                                    fontsize=7, color=style["color"], ha="center", va="top",
                                    rotation=90)
                    s = sel[(sel["impl"] == name) & sel[metric].notna()].sort_values("seqlen")
                    if not s.empty:
                        ax.plot(s["seqlen"], s[metric], label=name, **style)
                        drawn += 1
                ax.set_xscale("log", base=2)
                seqlens = sorted(set(sel["seqlen"]))
                ax.set_xticks(seqlens, [str(x) for x in seqlens])
                ax.xaxis.set_minor_locator(NullLocator())
                if log and drawn:
                    ax.set_yscale("log")
                title = f"{dtype} hdim {hdim} {'causal' if causal else 'non-causal'}"
                title += f" gqa {gqa}" if gqa != 1 else ""
                ax.set_title(f"{title}, {mode}", fontsize=9)
                ax.set_xlabel("seqlen")
                ax.set_ylabel(ylabel)
                ax.grid(True, which="both", alpha=0.3)
                if drawn:
                    ax.legend(fontsize=7)
                else:
                    ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center",
                            va="center")
        fig.suptitle(f"flash_attn_ext vs peers on {label}", fontsize=11)
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def write_outputs(rows: list[dict], impl_names: list[str], env: dict, notes: list[str],
                  out_dir: str, plot_title: str | None):
    """Write every file under ``out_dir`` (the plots unless ``plot_title`` is None).
    Returns (results DataFrame with ours_over_peer, {file name: path}, header, markdown table)."""
    import pandas as pd

    df = add_ratios(pd.DataFrame(rows))
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name)
             for name in ("results.csv", "results.json", "summary.csv", "summary.md")}
    df.to_csv(paths["results.csv"], index=False)
    records = json.loads(df.to_json(orient="records"))  # NaN -> null
    with open(paths["results.json"], "w") as f:
        json.dump({"environment": env, "notes": notes, "results": records}, f, indent=1)
    summary, _ = summarize(df, impl_names)
    summary.to_csv(paths["summary.csv"], index=False)
    header = header_text(env)
    md = to_markdown(compact_table(df, impl_names, ["sdpa-flash", "sdpa-cudnn"]))
    with open(paths["summary.md"], "w") as f:
        f.write(header + "\n\n" + md + "\n")
    if plot_title is not None:
        for p in plot(df, impl_names, out_dir, plot_title):
            paths[os.path.basename(p)] = p
    return df, paths, header, md
