"""Train a small byte-level GPT with flash_attn_ext attention and with torch SDPA, same seed, and
compare the loss curves.

Model: decoder-only transformer (Radford et al. 2018/2019: pre-LayerNorm blocks, GELU MLP, tied
input/output embedding) whose attention is ``flash_attn_ext.nn.MultiheadFlashAttention``
(causal, rotary position embedding — RoFormer, Su et al. 2021 — and grouped-query attention).
``--attn sdpa`` builds the identical model with ``backend="torch_sdpa"``: only the attention core
differs, so with the same seed both runs start from the same weights and see the same batches.

Data: real English text that ships with every Debian/Ubuntu system, the license texts in
/usr/share/common-licenses (GPL-3, GPL-2, LGPL-2.1, Apache-2.0, MPL-2.0, GFDL-1.3: ~200 KB),
concatenated, as bytes (vocabulary 256); the last 10% is the validation split.

    python examples/train_gpt.py                              # GPU: bf16 autocast, 600 steps
    python examples/train_gpt.py --device cpu --steps 30 --tiny
    python examples/train_gpt.py --attn-dropout 0.1           # attention dropout in training (each
                                                              # backend draws its own masks)

Prints the two curves side by side and a final table (final train loss = mean of the last 10
steps, validation loss, ms/step); writes every step's losses to --out-dir/--csv (default
train_gpt_out/losses.csv, a folder the repository's .gitignore ignores; an absolute --csv is
used as is, --csv "" writes nothing).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from flash_attn_ext.nn import MultiheadFlashAttention

TEXT_DIR = "/usr/share/common-licenses"
TEXT_FILES = ["GPL-3", "GPL-2", "LGPL-2.1", "Apache-2.0", "MPL-2.0", "GFDL-1.3"]
ATTN_BACKENDS = {"flash_attn_ext": "flash_attn_ext", "sdpa": "torch_sdpa"}
DEFAULT_OUT_DIR = "train_gpt_out"  # listed in .gitignore

CONFIGS = {  # d_model, heads, kv heads, layers, seqlen, batch, lr
    "default": dict(d_model=384, n_heads=6, n_kv_heads=2, n_layers=6, seqlen=256, batch=32, lr=1e-3),
    "tiny": dict(d_model=64, n_heads=2, n_kv_heads=1, n_layers=2, seqlen=64, batch=8, lr=3e-3),
}


def load_text(text_dir: str = TEXT_DIR, files=TEXT_FILES) -> torch.Tensor:
    """The concatenated files as a uint8 tensor of bytes. Raises FileNotFoundError naming the
    missing files."""
    paths = [os.path.join(text_dir, f) for f in files]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(
            "train_gpt: training text not found: " + ", ".join(missing) + ". These license texts "
            "ship with Debian/Ubuntu (package base-files); pass --text-dir/--text-files to use "
            "other plain-text files.")
    data = b"\n\n".join(open(p, "rb").read() for p in paths)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


class Block(nn.Module):
    def __init__(self, d_model, n_heads, n_kv_heads, backend, attn_dropout=0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = MultiheadFlashAttention(d_model, n_heads, num_kv_heads=n_kv_heads, bias=False,
                                            causal=True, rotary=True, backend=backend, dropout=attn_dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte-level causal LM. forward(idx (batch, seqlen) int64) -> logits (batch, seqlen, 256)."""

    def __init__(self, d_model, n_heads, n_kv_heads, n_layers, backend="flash_attn_ext", vocab=256, attn_dropout=0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, n_kv_heads, backend, attn_dropout)
                                    for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied embedding
        nn.init.normal_(self.embed.weight, std=0.02)
        for blk in self.blocks:  # GPT-2's scaled init of the residual projections
            nn.init.normal_(blk.attn.out_proj.weight, std=0.02 / math.sqrt(2 * n_layers))
            nn.init.normal_(blk.mlp[2].weight, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, idx):
        x = self.embed(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def get_batch(data, seqlen, batch, gen, device):
    starts = torch.randint(0, data.numel() - seqlen - 1, (batch,), generator=gen)
    rows = torch.stack([data[s: s + seqlen + 1] for s in starts.tolist()]).long()
    return rows[:, :-1].to(device), rows[:, 1:].to(device)


def train_one(attn, data_train, data_val, cfg, args):
    device = torch.device(args.device)
    torch.manual_seed(args.seed)  # same seed -> identical initial weights for every backend
    model = GPT(cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"], cfg["n_layers"],
                backend=ATTN_BACKENDS[attn], attn_dropout=args.attn_dropout).to(device)
    step_fn = torch.compile(model) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)) * 0.9 + 0.1)
    gen = torch.Generator().manual_seed(args.seed + 1)  # same batches for every backend
    use_autocast = args.dtype == "bf16"
    losses, times = [], []
    for step in range(args.steps):
        x, y = get_batch(data_train, cfg["seqlen"], cfg["batch"], gen, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
            logits = step_fn(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())  # .item() synchronizes
        times.append(time.perf_counter() - t0)
        if not math.isfinite(losses[-1]):
            raise RuntimeError(f"train_gpt[{attn}]: loss is {losses[-1]} at step {step}")
    model.eval()
    vgen = torch.Generator().manual_seed(args.seed + 2)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
        vals = []
        for _ in range(args.eval_batches):
            x, y = get_batch(data_val, cfg["seqlen"], cfg["batch"], vgen, device)
            vals.append(F.cross_entropy(model(x).float().view(-1, 256), y.reshape(-1)).item())
    skip = min(5, len(times) - 1)  # warm-up steps (allocator, compile) are not timed
    return dict(losses=losses, val_loss=sum(vals) / len(vals),
                ms_per_step=1e3 * sum(times[skip:]) / max(1, len(times) - skip))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attn", nargs="+", default=list(ATTN_BACKENDS), choices=list(ATTN_BACKENDS),
                   help="attention backends to train (default: both, same seed)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--tiny", action="store_true", help="tiny model (tests, CPU)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                   help="bf16 = torch.autocast bfloat16 (default on CUDA), fp32 (default on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--attn-dropout", type=float, default=0.0,
                   help="attention dropout probability in training (MultiheadFlashAttention's dropout; the "
                        "backends draw different masks, so their curves then agree statistically, not step "
                        "by step)")
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR,
                   help="folder for the outputs, created if missing (default: %(default)s, "
                        "ignored by git)")
    p.add_argument("--csv", default="losses.csv",
                   help="per-step losses (CSV), relative to --out-dir; '' to skip")
    p.add_argument("--text-dir", default=TEXT_DIR)
    p.add_argument("--text-files", nargs="+", default=TEXT_FILES)
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    return args


def main(argv=None):
    args = parse_args(argv)
    cfg = CONFIGS["tiny" if args.tiny else "default"]
    data = load_text(args.text_dir, args.text_files)
    n_val = data.numel() // 10
    data_train, data_val = data[:-n_val], data[-n_val:]
    print(f"train_gpt: {data.numel()} bytes of text ({len(args.text_files)} files), config "
          f"{'tiny' if args.tiny else 'default'} {cfg}, device {args.device}, {args.dtype}, "
          f"{args.steps} steps, seed {args.seed}")
    results = {a: train_one(a, data_train, data_val, cfg, args) for a in args.attn}

    names = list(results)
    every = max(1, args.steps // 10)
    print("\nstep  " + "  ".join(f"{n:>15}" for n in names))
    for s in list(range(0, args.steps, every)) + [args.steps - 1]:
        print(f"{s:>4}  " + "  ".join(f"{results[n]['losses'][s]:>15.4f}" for n in names))
    print("\nfinal table (train loss = mean of the last 10 steps; nats/byte)")
    print(f"{'attn':>15}  {'train loss':>10}  {'val loss':>8}  {'ms/step':>8}")
    for n in names:
        r = results[n]
        r["final_loss"] = sum(r["losses"][-10:]) / len(r["losses"][-10:])
        print(f"{n:>15}  {r['final_loss']:>10.4f}  {r['val_loss']:>8.4f}  {r['ms_per_step']:>8.2f}")
    if len(names) == 2:
        a, b = (results[n]["final_loss"] for n in names)
        print(f"relative difference of final train losses: {abs(a - b) / b:.2e}")
    if args.csv:
        path = os.path.join(args.out_dir, args.csv)  # an absolute --csv stays as given
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step"] + [f"loss_{n}" for n in names])
            for s in range(args.steps):
                w.writerow([s] + [f"{results[n]['losses'][s]:.6f}" for n in names])
        print(f"wrote {path}")
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
