"""The kernel manifest (csrc/kernels/generate_kernels.py), which setup.py reads: the generated
instantiation files match it, each build compiles the files of the arch paths it targets only, the
X-macros of csrc/generated/build_config.h follow the build, and every manifest row has its tile row.
No GPU and no build needed."""

import importlib.util
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def manifest():
    spec = importlib.util.spec_from_file_location("generate_kernels",
                                                  os.path.join(REPO, "csrc", "kernels", "generate_kernels.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _read(rel):
    with open(os.path.join(REPO, rel)) as f:
        return f.read()


def test_instantiation_files_are_the_generators_output(manifest):
    every = manifest.sources(["80", "90a"], manifest.HDIMS)
    for path, text in manifest.instantiations():
        assert path in every
        assert _read(path) == text, path
    on_disk = {f"csrc/kernels/{arch}/instantiations/{name}" for arch in manifest.MANIFEST
               for name in os.listdir(os.path.join(REPO, "csrc", "kernels", arch, "instantiations"))}
    assert on_disk == set(every), "stale or missing instantiation files: run python csrc/kernels/generate_kernels.py"


def test_sm90_files_only_in_builds_with_sm90a(manifest):
    sm80_only = manifest.sources(["80", "86"], [64, 128])
    assert sm80_only and not any("/sm90/" in p for p in sm80_only)
    with_90a = manifest.sources(["80", "90a"], [64, 128])
    # the sm80 forward's sm_90 row compiles in the sm90 folder, so for sm_90a only
    assert "csrc/kernels/sm90/instantiations/flash_fwd_sm80_hdim128_bf16_sm90.cu" in with_90a
    assert "csrc/kernels/sm90/instantiations/flash_fwd_sm80_hdim128_fp16_sm90.cu" in with_90a
    assert not any("fwd_sm80_hdim64" in p for p in with_90a)
    # likewise the sm90 forward's long-key row (d128)
    assert "csrc/kernels/sm90/instantiations/flash_fwd_long_hdim128_bf16_sm90.cu" in with_90a
    assert not any("fwd_long" in p for p in sm80_only)
    # and its short causal rows (d128 here; d256 too, not in this build's head dims)
    assert "csrc/kernels/sm90/instantiations/flash_fwd_short_hdim128_fp16_sm90.cu" in with_90a
    assert not any("fwd_short_hdim256" in p for p in with_90a)
    assert not any("fwd_short" in p for p in sm80_only)
    # and the sm90 dK/dV kernel's long-query rows (d64, d128; d96 too)
    assert "csrc/kernels/sm90/instantiations/flash_bwd_dkv_long_hdim64_fp16_sm90.cu" in with_90a
    assert "csrc/kernels/sm90/instantiations/flash_bwd_dkv_long_hdim128_bf16_sm90.cu" in with_90a
    assert not any("bwd_dkv_long" in p for p in sm80_only)
    # and its middle-length row (d96 only)
    assert "csrc/kernels/sm90/instantiations/flash_bwd_dkv_mid_hdim96_bf16_sm90.cu" in manifest.sources(["90a"], [96])
    assert not any("bwd_dkv_mid" in p for p in with_90a)
    assert not any("bwd_dkv_mid" in p for p in manifest.sources(["80"], [96]))
    # and the sm90 dQ kernel's short-sequence row (d128; d96 too, not in this build's head dims)
    assert "csrc/kernels/sm90/instantiations/flash_bwd_dq_short_hdim128_bf16_sm90.cu" in with_90a
    assert not any("bwd_dq_short_hdim64" in p or "bwd_dq_short_hdim96" in p for p in with_90a)
    assert not any("bwd_dq_short" in p for p in sm80_only)


def test_config_macros_follow_the_build(manifest):
    def macro(text, name):
        m = re.search(rf"^#define {name}\(X\) ?(.*)$", text, re.M)
        assert m, name
        return [int(x) for x in re.findall(r"X\((\d+)\)", m.group(1))]

    text = manifest.config_macros(["90a"], [64, 128])
    assert "#define FLASH_ATTN_EXT_WITH_SM90 1" in text
    assert macro(text, "FLASH_ATTN_EXT_HDIMS") == [64, 128]
    assert macro(text, "FLASH_ATTN_EXT_SM90_FWD_HDIMS") == [64, 128]
    assert macro(text, "FLASH_ATTN_EXT_SM90_FWD_SM80_HDIMS") == [128]
    assert macro(manifest.config_macros(["90a"], [64]), "FLASH_ATTN_EXT_SM90_FWD_SM80_HDIMS") == []
    assert macro(text, "FLASH_ATTN_EXT_SM90_FWD_LONG_HDIMS") == [128]
    assert macro(manifest.config_macros(["90a"], [64]), "FLASH_ATTN_EXT_SM90_FWD_LONG_HDIMS") == []
    assert macro(text, "FLASH_ATTN_EXT_SM90_FWD_SHORT_HDIMS") == [128]
    assert macro(manifest.config_macros(["90a"], [64]), "FLASH_ATTN_EXT_SM90_FWD_SHORT_HDIMS") == []
    assert macro(text, "FLASH_ATTN_EXT_SM90_BWD_DKV_LONG_HDIMS") == [64, 128]
    assert macro(manifest.config_macros(["90a"], [192]), "FLASH_ATTN_EXT_SM90_BWD_DKV_LONG_HDIMS") == []
    assert macro(text, "FLASH_ATTN_EXT_SM90_BWD_DKV_MID_HDIMS") == []
    assert macro(manifest.config_macros(["90a"], [64, 96]), "FLASH_ATTN_EXT_SM90_BWD_DKV_MID_HDIMS") == [96]
    assert macro(text, "FLASH_ATTN_EXT_SM90_BWD_DQ_SHORT_HDIMS") == [128]
    assert macro(manifest.config_macros(["90a"], [64]), "FLASH_ATTN_EXT_SM90_BWD_DQ_SHORT_HDIMS") == []
    text = manifest.config_macros(["80"], [64, 128])
    assert "FLASH_ATTN_EXT_WITH_SM90" not in text
    for name in ("FLASH_ATTN_EXT_SM90_FWD_HDIMS", "FLASH_ATTN_EXT_SM90_BWD_HDIMS",
                 "FLASH_ATTN_EXT_SM90_FWD_SM80_HDIMS", "FLASH_ATTN_EXT_SM90_FWD_LONG_HDIMS",
                 "FLASH_ATTN_EXT_SM90_FWD_SHORT_HDIMS", "FLASH_ATTN_EXT_SM90_BWD_DKV_LONG_HDIMS",
                 "FLASH_ATTN_EXT_SM90_BWD_DKV_MID_HDIMS", "FLASH_ATTN_EXT_SM90_BWD_DQ_SHORT_HDIMS"):
        assert macro(text, name) == []


def test_every_manifest_row_has_a_tile_row(manifest):
    tables = {arch: _read(f"csrc/kernels/{arch}/tile_config.h") for arch in manifest.MANIFEST}
    struct = {"fwd": "FwdTile", "bwd_dkv": "DkvTile", "bwd_dq": "DqTile", "fwd_splitkv": "SplitKvTile",
              "fwd_sm80": "Sm80FwdTile", "fwd_long": "FwdLongTile", "fwd_short": "FwdShortTile",
              "bwd_dkv_long": "DkvLongTile", "bwd_dkv_mid": "DkvMidTile", "bwd_dq_short": "DqShortTile"}
    for arch, (_, _, kinds) in manifest.MANIFEST.items():
        for kind, hdims in kinds.items():
            for hdim in hdims:
                assert re.search(rf"struct {struct[kind]}<{hdim}>\s*:", tables[arch]), (arch, kind, hdim)
