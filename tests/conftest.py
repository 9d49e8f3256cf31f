"""Shared pytest setup: report header with the build facts, input factories, output poisoning, test
shards (FLASH_ATTN_EXT_TEST_SHARD) and the GPU-only selection (FLASH_ATTN_EXT_TEST_GPU_ONLY)."""

import os
import re
import warnings

import pytest
import torch

import flash_attn_ext


def pytest_report_header(config):
    info = flash_attn_ext.build_info()
    cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (GPU tests skip)"
    return [f"flash_attn_ext {flash_attn_ext.__version__}: build_info={info}", f"torch {torch.__version__}, GPU: {cuda}"]


SHARD_ENV = "FLASH_ATTN_EXT_TEST_SHARD"


def parse_shard(value: str) -> tuple[int, int]:
    """(i, n) of a FLASH_ATTN_EXT_TEST_SHARD value "i/n", 1 <= i <= n; a clear error otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", value)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise pytest.UsageError(f"{SHARD_ENV} must be 'i/n' with 1 <= i <= n, got {value!r}")
    return int(m.group(1)), int(m.group(2))


GPU_ONLY_ENV = "FLASH_ATTN_EXT_TEST_GPU_ONLY"


def is_cpu_only(item) -> bool:
    """A test that never touches a GPU: its ``device`` parameter is the CPU, its name has the word
    ``cpu`` (``test_sinks_cpu_window``, ``test_cli_cpu_tiny``), or it is in test_cpu_attention.py."""
    params = getattr(item, "callspec", None)
    device = params.params.get("device") if params is not None else None
    if device is not None and torch.device(device).type == "cpu":
        return True
    return item.path.name == "test_cpu_attention.py" or "cpu" in item.originalname.split("_")


def pytest_collection_modifyitems(config, items):
    """FLASH_ATTN_EXT_TEST_GPU_ONLY=1 leaves out the CPU-only tests (is_cpu_only; CI runs them), and
    FLASH_ATTN_EXT_TEST_SHARD=i/n then runs the i-th of n shards of the selected tests: every n-th
    test in collection order from the i-th, so each shard holds a like mix of every file (the GPU
    suite does not fit one device call: scripts/gpu_run.sh's GPU_ONLY and SHARD)."""
    gpu_only = os.environ.get(GPU_ONLY_ENV, "").strip()
    if gpu_only not in ("", "0", "1"):
        raise pytest.UsageError(f"{GPU_ONLY_ENV} must be 0 or 1, got {gpu_only!r}")
    if gpu_only == "1":
        config.hook.pytest_deselected(items=[item for item in items if is_cpu_only(item)])
        items[:] = [item for item in items if not is_cpu_only(item)]
    value = os.environ.get(SHARD_ENV, "")
    if not value.strip():
        return
    i, n = parse_shard(value)
    keep = [item for k, item in enumerate(items) if k % n == i - 1]
    config.hook.pytest_deselected(items=[item for k, item in enumerate(items) if k % n != i - 1])
    items[:] = keep


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def poison_empty():
    """Make torch.empty (also at::empty inside the extension) fill new float tensors with NaN, so
    an output element a kernel forgets to write shows up as NaN. warn_only: strict deterministic
    mode would reject the reference's cuBLAS matmuls on CUDA unless CUBLAS_WORKSPACE_CONFIG is set."""
    old = torch.are_deterministic_algorithms_enabled()
    old_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    old_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    torch.use_deterministic_algorithms(old, warn_only=old_warn)
    torch.utils.deterministic.fill_uninitialized_memory = old_fill


def compiled_hdims():
    """The CUDA head dims this build compiled (build_info), [] for a CPU-only build."""
    info = flash_attn_ext.build_info()
    if not info.get("with_cuda"):
        return []
    return sorted(int(x) for x in str(info.get("head_dims", "")).split(",") if x.strip())


def require_hdim(d, exact=False):
    """Skip, naming why, when this build has no CUDA kernel for head dim ``d``: none compiled, or
    no compiled head dim >= d (``exact``: d itself not compiled), e.g. a narrowed dev build."""
    compiled = compiled_hdims()
    if not compiled:
        pytest.skip("flash_attn_ext was built without CUDA kernels")
    if (d not in compiled) if exact else not any(h >= d for h in compiled):
        pytest.skip(f"head dim {d} is not covered by this build's CUDA head dims {compiled} (FLASH_ATTN_EXT_HDIMS)")


def kernel_bool_args(name: str) -> list[bool]:
    """The trailing bool template arguments of a CUDA kernel's profiler name, demangled
    (`..., true, false>(`) or not (`Lb1ELb0EEEv`), in order: the kernels' twin flags (e.g. the
    split-KV kernel's kLocal, kSoftcap, kAlibi, kBalanced; the combine's kBalanced)."""
    demangled = re.findall(r"((?:\b(?:true|false),\s*)*\b(?:true|false))>\s*\(", name)
    if demangled:
        return [f == "true" for f in re.findall(r"true|false", demangled[-1])]
    mangled = re.findall(r"((?:Lb[01]E)+)EEv", name)
    assert mangled, f"no bool template arguments in {name!r}"
    return [f == "1" for f in re.findall(r"Lb([01])E", mangled[-1])]


def run_hdim(d):
    """The compiled CUDA head dim a call of head dim ``d`` runs (dispatch.cu's rounded_headdim: the
    smallest compiled one >= d), e.g. 128 for d96 in a build narrowed to 128."""
    return min(h for h in compiled_hdims() if h >= d)


def make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, device="cpu", requires_grad=True):
    """Fresh random BSHD q, k, v (standard normal, never zeros)."""
    def rnd(*shape):
        return torch.randn(*shape, dtype=dtype, device=device).requires_grad_(requires_grad)

    return (rnd(batch, seqlen_q, nheads, headdim), rnd(batch, seqlen_k, nheads_k, headdim),
            rnd(batch, seqlen_k, nheads_k, headdim))


# Packed sequences for the varlen cells: lengths with an empty query / key sequence and a one-key one.
VARLEN_LENS_Q, VARLEN_LENS_K = [37, 0, 130, 64], [50, 20, 130, 1]


def make_varlen_qkv(nheads, nheads_k, headdim, dtype, device="cpu", lens_q=VARLEN_LENS_Q, lens_k=VARLEN_LENS_K):
    """Fresh random packed q (total_q, nheads, headdim), k, v (total_k, nheads_k, headdim) that
    require grad, and int32 cu_seqlens_q / cu_seqlens_k on ``device`` for the sequence lengths."""
    def cu(lens):
        return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)

    def rnd(total, heads):
        return torch.randn(total, heads, headdim, dtype=dtype, device=device, requires_grad=True)

    return (rnd(sum(lens_q), nheads), rnd(sum(lens_k), nheads_k), rnd(sum(lens_k), nheads_k), cu(lens_q),
            cu(lens_k))


@pytest.fixture
def qkv_factory():
    return make_qkv


def check_fwd_bwd(q, k, v, run, reference, dout=None):
    """Forward + backward of ``run()`` -> (out, softmax_lse) vs ``reference(upcast)`` -> (out, lse)
    (tests/accuracy.py rule: upcast=True is the float64 reference, upcast=False the same-dtype
    baseline), gradients w.r.t. q, k, v (which must require grad). Returns (out, softmax_lse,
    (dq, dk, dv))."""
    from accuracy import check_accuracy

    out, lse = run()
    ref_out, ref_lse = reference(True)
    base_out, base_lse = reference(False)
    check_accuracy("out", out, ref_out, base_out)
    check_accuracy("softmax_lse", lse, ref_lse, base_lse)
    if dout is None:
        dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout.to(ref_out.dtype))
    base_grads = torch.autograd.grad(base_out, (q, k, v), dout)
    for name, g, rg, bg in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads):
        check_accuracy(name, g, rg, bg)
    return out, lse, grads


def check_against_reference(q, k, v, causal=False, softmax_scale=None, dout=None):
    """Forward + backward of flash_attn_func vs the float64 reference (check_fwd_bwd). q, k, v
    must require grad (they may be views, e.g. slices of a fused qkv tensor)."""
    from flash_attn_ext.reference import attention_ref

    return check_fwd_bwd(
        q, k, v,
        lambda: flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=True),
        lambda upcast: attention_ref(q, k, v, softmax_scale, causal, upcast=upcast), dout)


@pytest.fixture
def check_attention():
    return check_against_reference


@pytest.fixture(params=["auto", "sm80"])
def arch_path(request):
    """The CUDA arch paths a test runs on: "auto" (what the dispatch picks: the sm90 wgmma kernels on
    an sm_90 GPU for the kernels and head dims they cover, sm80 otherwise) and, on sm_90 with a
    build that has sm_90a code, "sm80" (flash_attn_ext.force_sm80_path)."""
    if request.param == "sm80":
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the sm80 path is the only CUDA path on this machine")
        if "90a" not in flash_attn_ext.build_info().get("cuda_archs", ""):
            pytest.skip("this build has no sm_90a code, so the sm80 path is the default")
        previous = flash_attn_ext.force_sm80_path(True)
        yield request.param
        flash_attn_ext.force_sm80_path(previous)
    else:
        yield request.param
