"""examples/train_gpt.py: a byte-level GPT built from MultiheadFlashAttention (causal, rotary, GQA)
trained on /usr/share/common-licenses text with flash_attn_ext and with torch SDPA, same seed."""

import csv
import importlib.util
import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_example():
    spec = importlib.util.spec_from_file_location("train_gpt", os.path.join(ROOT, "examples",
                                                                           "train_gpt.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


train_gpt = _load_example()
needs_text = pytest.mark.skipif(
    not all(os.path.isfile(os.path.join(train_gpt.TEXT_DIR, f)) for f in train_gpt.TEXT_FILES),
    reason=f"the Debian license texts in {train_gpt.TEXT_DIR} are not on this machine")


@needs_text
def test_tiny_cpu_curves_agree_and_decrease(tmp_path, capsys):
    path = tmp_path / "losses.csv"
    res = train_gpt.main(["--device", "cpu", "--steps", "30", "--tiny", "--csv", str(path)])
    ours, ref = res["flash_attn_ext"], res["sdpa"]
    for name, r in res.items():
        first, last = sum(r["losses"][:5]) / 5, sum(r["losses"][-5:]) / 5
        assert all(math.isfinite(x) for x in r["losses"]), name
        assert last < 0.75 * first, f"{name}: loss did not decrease ({first:.3f} -> {last:.3f})"
        assert r["val_loss"] < 0.75 * r["losses"][0], name
    # Same seed, same batches, only the attention core differs: the curves agree to within
    # float32 run-to-run noise (a few % is the bound; observed ~1e-6 relative).
    assert abs(ours["final_loss"] - ref["final_loss"]) <= 0.03 * ref["final_loss"]
    assert abs(ours["val_loss"] - ref["val_loss"]) <= 0.03 * ref["val_loss"]
    for s, (a, b) in enumerate(zip(ours["losses"], ref["losses"])):
        assert abs(a - b) <= 0.03 * b, f"step {s}: {a} vs {b}"
    rows = list(csv.reader(open(path)))
    assert rows[0] == ["step", "loss_flash_attn_ext", "loss_sdpa"] and len(rows) == 31
    assert float(rows[-1][1]) == pytest.approx(ours["losses"][-1], abs=1e-6)
    out = capsys.readouterr().out
    assert "final table" in out and "flash_attn_ext" in out and "sdpa" in out


@needs_text
def test_tiny_cpu_training_with_attention_dropout(tmp_path):
    """--attn-dropout trains both backends with attention dropout (their masks differ): finite,
    decreasing losses, and the final losses within 10 % of each other."""
    res = train_gpt.main(["--device", "cpu", "--steps", "30", "--tiny", "--attn-dropout", "0.1", "--csv", ""])
    for name, r in res.items():
        first, last = sum(r["losses"][:5]) / 5, sum(r["losses"][-5:]) / 5
        assert all(math.isfinite(x) for x in r["losses"]) and last < 0.75 * first, name
    ours, ref = res["flash_attn_ext"]["final_loss"], res["sdpa"]["final_loss"]
    assert abs(ours - ref) <= 0.1 * ref


def test_missing_text_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="base-files"):
        train_gpt.main(["--device", "cpu", "--steps", "1", "--tiny", "--text-dir", str(tmp_path),
                        "--csv", ""])
