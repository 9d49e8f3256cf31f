"""Speed of a Hugging Face model end to end with attn_implementation="fa_ext" (flash_attn_ext's
integration) against "sdpa" (and "flash_attention_2" where the flash-attn package imports): a
random-weight Llama built from a config (no download), one training step (forward + backward of
the loss) and one forward, on the batch layouts users train on:

  none    every sequence full length (no mask: one dense call per layer)
  right   right padding to the longest sequence, lengths from 1/4 of it to all of it
  left    the same lengths, left padded
  packed  the same sequences packed in one row (DataCollatorWithFlattening, use_cache=False: the
          block-diagonal mask; sdpa computes it too)

A diagnostic of the integration's own cost (unpadding, the mask's analysis, its host syncs) next to
the attention kernels, not the benchmark (flash_attn_ext.benchmark times the kernels' cases):
prints ms per step and tokens per second (real tokens) per (layout, implementation), and ours over
sdpa. The padded layouts' masks are analysed once per forward (flash_attn_ext.masked.plan_for).

    python scripts/hf_bench.py [--layers 8] [--hidden 2048] [--heads 16] [--kv-heads 8] [--batch 8] [--seqlen 2048]
                               [--no-plan-cache]
    python scripts/hf_bench.py --device cpu --layers 2 --hidden 64 --heads 4 --kv-heads 2 --batch 2 --seqlen 32 --rep-ms 1
"""
import argparse

import torch

import flash_attn_ext.integrations as fx
from flash_attn_ext.bench.timing import Timer


def lengths(batch: int, seqlen: int) -> list[int]:
    """Sequence lengths from seqlen / 4 to seqlen, evenly spread (the last one full)."""
    if batch == 1:
        return [seqlen]
    return [seqlen // 4 + (seqlen - seqlen // 4) * i // (batch - 1) for i in range(batch)]


def layout_batch(layout: str, ids: torch.Tensor, lens: list[int]) -> dict:
    """Model inputs (input_ids, attention_mask or position_ids, labels) for one layout."""
    batch, seqlen = ids.shape
    if layout == "none":
        return {"input_ids": ids, "labels": ids}
    if layout == "packed":
        from transformers import DataCollatorWithFlattening

        out = DataCollatorWithFlattening()([{"input_ids": ids[b, :n].tolist()} for b, n in enumerate(lens)])
        return {k: t.to(ids.device) for k, t in out.items()}
    pos = torch.arange(seqlen, device=ids.device)[None, :]
    n = torch.tensor(lens, device=ids.device)[:, None]
    mask = pos >= seqlen - n if layout == "left" else pos < n
    return {"input_ids": ids, "attention_mask": mask.long(), "labels": ids.masked_fill(~mask, -100)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--layouts", default="none,right,left,packed")
    ap.add_argument("--rep-ms", type=float, default=200.0, help="timed repetitions per measurement (the benchmark's Timer)")
    ap.add_argument("--no-plan-cache", action="store_true",
                    help="analyse a padding mask in every layer (flash_attn_ext.masked's plans not kept): what "
                    "the kept analysis saves on the padded layouts")
    args = ap.parse_args(argv)
    if args.no_plan_cache:
        import flash_attn_ext.masked as masked

        plan_for = masked.plan_for

        def uncached(*a):
            masked._PLANS.clear()
            return plan_for(*a)
        masked.plan_for = uncached
    from transformers import LlamaConfig, LlamaForCausalLM

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = fx.register_transformers()
    impls = ["sdpa", name]   # sdpa first: the others' row shows sdpa's ms over theirs
    try:
        import flash_attn  # noqa: F401

        impls.append("flash_attention_2")
    except Exception:  # noqa: BLE001 - any import failure means the peer is absent
        pass
    cfg = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 4,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seqlen, 64))
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).train()
    ids = torch.randint(3, cfg.vocab_size, (args.batch, args.seqlen), device=device)
    lens = lengths(args.batch, args.seqlen)
    timer = Timer(device, warmup_ms=min(50.0, args.rep_ms), rep_ms=args.rep_ms)
    print(f"Llama {args.layers} layers, hidden {args.hidden}, heads {args.heads}:{args.kv_heads}, {dtype}, {device}; "
          f"batch {args.batch} x {args.seqlen}, padded lengths {lens[0]}..{lens[-1]}")
    print("| layout | impl | pass | ms | real tokens/s | speed x sdpa |")
    print("|---|---|---|---|---|---|")
    for layout in args.layouts.split(","):
        inputs = layout_batch(layout, ids, lens)
        real = sum(lens) if layout != "none" else args.batch * args.seqlen
        times = {}
        for impl in impls:
            model.set_attn_implementation(impl)

            def step():
                model(**inputs, use_cache=False).loss.backward()

            def forward():
                with torch.no_grad():
                    model(**inputs, use_cache=False)

            for label, fn in (("train step", step), ("forward", forward)):
                try:
                    ms = timer(fn)
                except Exception as e:  # noqa: BLE001 - a peer that refuses the case is recorded, not fatal
                    print(f"| {layout} | {impl} | {label} | {type(e).__name__}: {str(e)[:60]} | | |")
                    continue
                times[(impl, label)] = ms
                base = times.get(("sdpa", label))
                ratio = "" if base is None or impl == "sdpa" else f"{base / ms:.2f}"
                print(f"| {layout} | {impl} | {label} | {ms:.2f} | {real / ms * 1e3:,.0f} | {ratio} |", flush=True)
            model.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
