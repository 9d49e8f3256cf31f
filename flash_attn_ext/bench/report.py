"""Tables, files and plots of a sweep's rows; the one module that imports pandas and matplotlib
(lazily: the other modules run without them).

Files under --out: results.csv / results.json (one row per case and implementation, with status
'ok', 'n/a', 'OOM', 'skipped' or 'error' and a note; the JSON adds the environment), summary.csv
and summary.md (one row per case), tflops.png (TFLOP/s vs seqlen per config, every
implementation) and memory.png (peak extra memory vs seqlen, against standard attention).
ours/<peer>: flash_attn_ext TFLOP/s divided by the peer's TFLOP/s (> 1: flash_attn_ext is faster).

Decode and varlen rows (modes decode, varlen_fwd, varlen_bwd) share results.csv / .json (columns
of the other families empty) and get their own tables in summary.md and on stdout, before the
dense table (which stays last), and their own summary_decode.csv / summary_varlen.csv; no plots.
Decode: TB/s of K+V read (the used lengths' bytes where --decode-fill < 1; the table then has
a fill column and its text says how the lengths are drawn), ours/<peer> the TB/s ratio,
ours/contig ours at this page size over ours on the contiguous cache (timed in the same
interleaved rounds, bench.sweeps). Varlen: TFLOP/s on the real work; ours-dense is
flash_attn_func on as many tokens at batch tokens/S x seqlen S (--varlen-dense-seqlen), same
heads, timed in the same interleaved rounds as the varlen case.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex

import torch

from flash_attn_ext.bench.peers import OURS, OURS_DENSE, BenchmarkError
from flash_attn_ext.bench.timing import Timer, l2_bytes

CASE_KEYS = ["dtype", "hdim", "causal", "gqa", "seqlen", "batch", "nheads", "nheads_k", "mode"]
DECODE_KEYS = ["dtype", "hdim", "gqa", "nheads", "nheads_k", "batch", "seqlen_k", "fill", "page_size",
               "mode"]
VARLEN_KEYS = ["dtype", "hdim", "causal", "gqa", "nheads", "nheads_k", "n_seqs", "tokens",
               "min_len", "max_len", "mode"]
FAMILY_KEYS = {"dense": CASE_KEYS, "decode": DECODE_KEYS, "varlen": VARLEN_KEYS}
FAMILY_METRIC = {"dense": "tflops", "decode": "tbps", "varlen": "tflops"}
UNIT = {"tflops": "TFLOP/s", "tbps": "TB/s"}
LABEL = {OURS: "ours", OURS_DENSE: "ours-dense"}
IMPL_STYLE = {OURS: dict(color="black", linewidth=2.5, marker="o")}
_INT_COLUMNS = {"hdim", "gqa", "seqlen", "batch", "nheads", "nheads_k", "seqlen_k", "page_size",
                "n_seqs", "tokens", "min_len", "max_len", "n_input_sets"}


def family(mode: str) -> str:
    """dense (fwd, bwd, fwd_bwd), decode or varlen (varlen_fwd, varlen_bwd)."""
    return "decode" if mode == "decode" else "varlen" if mode.startswith("varlen") else "dense"


DECODE_CACHE = {
    "full": "a full cache (cache_seqlens = Nk for every sequence); TB/s = K+V bytes read "
            "(2*B*Nk*nheads_k*hdim*elem) / median time",
    "ragged": "a ragged cache, fill F (--decode-fill): sequence lengths (cache_seqlens) spread "
              "evenly over [F*Nk - w, F*Nk + w], w = min(F, 1 - F)*Nk, in a seeded order, mean "
              "F*Nk; TB/s = K+V bytes of the used lengths (2*sum(cache_seqlens)*nheads_k*hdim*elem) "
              "/ median time; SDPA and standard attend with a key mask (they read the whole cache, "
              "n/a where the backend has no masked kernel)",
}
DECODE_TEXT = ("Decode (KV cache): seqlen_q = 1 against {cache}; page: "
               "paged KV page size (contig: one contiguous cache; SDPA has no paged entry: n/a); "
               "ours = flash_attn_with_kvcache(num_splits=0); ours/<peer> = ratio of TB/s; "
               "ours/contig = ours at this page size / ours contiguous (each case's page sizes "
               "timed in the same interleaved rounds); err = max |out - float64 "
               "reference| over the timed call's first and last sequences and KV heads.")
VARLEN_TEXT = ("Varlen: {n_seqs} sequences of seeded mixed lengths {lens} ({tokens} tokens), "
               "q and k alike; TFLOP/s on the real per-sequence work (sum of 4*L^2*hdim*heads, "
               "halved when causal; varlen_bwd = the backward alone, 2.5x); ours-dense = "
               "flash_attn_func at {dense} with the same heads (the dense op on as many tokens, "
               "with its own work); SDPA has no varlen entry; ours/<peer> = ratio of TFLOP/s; "
               "err = max |x - float64 reference| (out for varlen_fwd, max of dq/dk/dv for "
               "varlen_bwd) over the timed call's first and last KV heads, the reference of each "
               "sequence alone.")
DENSE_TEXT = ("TFLOP/s by the standard count (fwd 4*B*H*N^2*d, halved when causal; bwd 2.5x, "
              "fwd_bwd 3.5x); ours/<peer> = ratio of TFLOP/s (> 1: ours faster); err = max |x - "
              "float64 reference| (out for fwd, max of dq/dk/dv otherwise) over the timed call's "
              "first and last batch items and KV heads.")


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


def _pivot(df, values: str, keys=CASE_KEYS):
    """Case x implementation table of ``values`` (first value per cell, NaN where missing)."""
    return df.pivot_table(index=keys, columns="impl", values=values, aggfunc="first",
                          sort=False, dropna=False)


def _fmt(x, spec: str) -> str:
    """``x`` formatted with ``spec``; "" for NaN."""
    return format(x, spec) if x == x else ""


def add_ratios(df, fam: str = "dense"):
    """Column ``ours_over_peer`` = flash_attn_ext's metric / this row's (same case of family
    ``fam``: TFLOP/s, or TB/s for decode)."""
    keys, metric = FAMILY_KEYS[fam], FAMILY_METRIC[fam]
    ours = df[df["impl"] == OURS].set_index(keys)[metric]
    keyed = df.set_index(keys)
    df = df.copy()
    df["ours_over_peer"] = (ours.reindex(keyed.index).to_numpy() / keyed[metric].to_numpy())
    return df


def summarize(df, impl_names: list[str], fam: str = "dense"):
    """One row per case: the metric per implementation (or its status), ours/peer ratios, errors
    (decode also the median ms of each implementation)."""
    import pandas as pd

    keys, metric = FAMILY_KEYS[fam], FAMILY_METRIC[fam]
    cell = df[metric].map(lambda x: _fmt(x, ".3g"))
    cell = cell.where(df["status"] == "ok", df["status"])
    wide = df.assign(cell=cell).pivot_table(index=keys, columns="impl", values="cell",
                                            aggfunc="first", sort=False)
    num, errs = _pivot(df, metric, keys), _pivot(df, "err", keys)
    ms = _pivot(df, "ms", keys)
    out = pd.DataFrame(index=wide.index)
    for name in impl_names:
        out[f"{name} {UNIT[metric]}"] = num[name] if name in num else float("nan")
    if fam == "decode":
        for name in impl_names:
            out[f"{name} ms"] = ms[name] if name in ms else float("nan")
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


def _shown_and_ratio_peers(df, impl_names, num):
    """Implementations that ran somewhere (not n/a everywhere), and the peers with a number."""
    shown = [n for n in impl_names if (df[(df["impl"] == n)]["status"] != "n/a").any()]
    return shown, [n for n in shown if n != OURS and n in num and num[n].notna().any()]


def decode_text(df) -> str:
    """DECODE_TEXT for the decode rows ``df``: a full cache, or a ragged one where some row's fill
    (--decode-fill) is below 1."""
    ragged = "fill" in df and (df["fill"].fillna(1.0) < 1.0).any()
    return DECODE_TEXT.format(cache=DECODE_CACHE["ragged" if ragged else "full"])


def decode_table(df, impl_names: list[str]):
    """The decode table: case (with fill where some row's is below 1), timing (eager or graph),
    TB/s of each implementation, ours' ms, ours/peer for every peer, ours/contig, and ours' max
    error."""
    import pandas as pd

    _, wide = summarize(df, impl_names, "decode")
    index = wide.set_index(DECODE_KEYS).index
    num = _pivot(df, "tbps", DECODE_KEYS).reindex(index)
    ms, errs = _pivot(df, "ms", DECODE_KEYS).reindex(index), _pivot(df, "err", DECODE_KEYS).reindex(index)
    shown, peers = _shown_and_ratio_peers(df, impl_names, num)
    t = pd.DataFrame({"dtype": wide["dtype"], "hdim": wide["hdim"],
                      "heads": [f"{a}:{b}" for a, b in zip(wide["nheads"], wide["nheads_k"])],
                      "batch": wide["batch"], "Nk": wide["seqlen_k"],
                      "page": wide["page_size"].map(lambda x: "contig" if x == 0 else str(x))})
    if (wide["fill"] < 1.0).any():  # a ragged cache (--decode-fill): not the full-cache rows
        t.insert(5, "fill", wide["fill"].map(lambda x: f"{x:g}"))
    if "timing" in df:  # eager calls or CUDA graph replays (--decode-graph)
        t["timing"] = df.drop_duplicates(DECODE_KEYS).set_index(DECODE_KEYS)["timing"].reindex(index).to_numpy()
    for n in shown:
        t[LABEL.get(n, n)] = wide[n].fillna("").to_numpy() if n in wide else ""
    if OURS in ms:
        t["ms ours"] = [_fmt(x, ".3g") for x in ms[OURS].to_numpy()]
    for r in peers:
        t[f"ours/{r}"] = [_fmt(x, ".2f") for x in (num[OURS] / num[r]).to_numpy()]
    if OURS in num:
        ours = num[OURS]
        contig_keys = [k for k in DECODE_KEYS if k != "page_size"]
        frame = ours.reset_index()
        base = frame[frame["page_size"] == 0].set_index(contig_keys)[OURS]
        contig = base.reindex(frame.set_index(contig_keys).index).to_numpy()
        if (frame["page_size"] != 0).any() and len(base):
            t["ours/contig"] = [_fmt(x, ".2f") for x in ours.to_numpy() / contig]
    if OURS in errs:
        t["err ours"] = [_fmt(x, ".1e") for x in errs[OURS].to_numpy()]
    return t


def varlen_table(df, impl_names: list[str]):
    """The varlen table: case, TFLOP/s of ours, ours-dense and each peer, ours/each, ours' error."""
    import pandas as pd

    _, wide = summarize(df, impl_names, "varlen")
    index = wide.set_index(VARLEN_KEYS).index
    num = _pivot(df, "tflops", VARLEN_KEYS).reindex(index)
    errs = _pivot(df, "err", VARLEN_KEYS).reindex(index)
    shown, peers = _shown_and_ratio_peers(df, impl_names, num)
    t = pd.DataFrame({"dtype": wide["dtype"], "hdim": wide["hdim"],
                      "causal": wide["causal"].map(lambda c: "yes" if c else "no"),
                      "mode": wide["mode"], "seqs": wide["n_seqs"], "tokens": wide["tokens"],
                      "lens": [f"{a}..{b}" for a, b in zip(wide["min_len"], wide["max_len"])]})
    if (wide["gqa"] != 1).any():
        t.insert(3, "gqa", wide["gqa"])
    for n in shown:
        t[LABEL.get(n, n)] = wide[n].fillna("").to_numpy() if n in wide else ""
    for r in peers:
        t[f"ours/{LABEL.get(r, r)}"] = [_fmt(x, ".2f") for x in (num[OURS] / num[r]).to_numpy()]
    if OURS in errs:
        t["err ours"] = [_fmt(x, ".1e") for x in errs[OURS].to_numpy()]
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
    """The lines above the tables (stdout and summary.md): device, timer, command."""
    return (f"flash_attn_ext benchmark on {device_label(env)} ({env['device']}), torch {env['torch']}; "
            f"timer: {env['timer']}.\nCommand: {env['command']}")


def varlen_text(df, env: dict) -> str:
    """VARLEN_TEXT filled in from the varlen rows and the environment."""
    first = df.iloc[0]
    return VARLEN_TEXT.format(n_seqs=first["n_seqs"], tokens=first["tokens"],
                              lens=f"{first['min_len']}..{first['max_len']}",
                              dense=env.get("varlen_dense", "the dense comparison shape"))


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


def write_outputs(rows: list[dict], impl_names, env: dict, notes: list[str],
                  out_dir: str, plot_title: str | None):
    """Write every file under ``out_dir`` (the plots of the dense rows unless ``plot_title`` is
    None). ``impl_names``: {family: names} (a list: the dense family's). Returns (results
    DataFrame with ours_over_peer, {file name: path}, header, markdown of the tables: decode,
    varlen, then dense last)."""
    import pandas as pd

    if not isinstance(impl_names, dict):
        impl_names = {"dense": list(impl_names)}
    frames = {}
    for fam in ("decode", "varlen", "dense"):
        fam_rows = [r for r in rows if family(r["mode"]) == fam]
        if fam_rows:
            frames[fam] = add_ratios(pd.DataFrame(fam_rows), fam)
    df = pd.concat([frames[f] for f in ("dense", "decode", "varlen") if f in frames],
                   ignore_index=True)
    for col in _INT_COLUMNS & set(df.columns):  # keep integers integers where families mix
        if df[col].dtype.kind == "f" and (df[col].dropna() % 1 == 0).all():
            df[col] = df[col].astype("Int64")
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name) for name in ("results.csv", "results.json")}
    df.to_csv(paths["results.csv"], index=False)
    records = json.loads(df.to_json(orient="records"))  # NaN -> null
    with open(paths["results.json"], "w") as f:
        json.dump({"environment": env, "notes": notes, "results": records}, f, indent=1)
    sections = []
    for fam, fdf in frames.items():
        names = impl_names.get(fam, [])
        summary, _ = summarize(fdf, names, fam)
        name = "summary.csv" if fam == "dense" else f"summary_{fam}.csv"
        paths[name] = os.path.join(out_dir, name)
        summary.to_csv(paths[name], index=False)
        if fam == "decode":
            sections.append(decode_text(fdf) + "\n\n" + to_markdown(decode_table(fdf, names)))
        elif fam == "varlen":
            sections.append(varlen_text(fdf, env) + "\n\n" + to_markdown(varlen_table(fdf, names)))
        else:
            sections.append(DENSE_TEXT + "\n\n" + to_markdown(
                compact_table(fdf, names, ["sdpa-flash", "sdpa-cudnn"])))
    header = header_text(env)
    md = "\n\n".join(sections)
    paths["summary.md"] = os.path.join(out_dir, "summary.md")
    with open(paths["summary.md"], "w") as f:
        f.write(header + "\n\n" + md + "\n")
    if plot_title is not None and "dense" in frames:
        for p in plot(frames["dense"], impl_names["dense"], out_dir, plot_title):
            paths[os.path.basename(p)] = p
    return df, paths, header, md
