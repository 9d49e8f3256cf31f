"""The op surface: torch.library registration (opcheck), autograd, torch.compile, gradcheck,
non-contiguous layouts, build_info."""

import importlib.util
import math
import os
import re

import pytest
import torch

import flash_attn_ext
from flash_attn_ext.reference import attention_ref


def test_build_info():
    info = flash_attn_ext.build_info()
    assert set(info) >= {"with_cuda", "cuda_archs", "head_dims", "cuda_version", "torch_version"}
    assert info["torch_version"] == torch.__version__, "extension built against another torch: rebuild"
    if info["with_cuda"]:
        assert info["cuda_archs"] and info["head_dims"] and info["cuda_version"]
    assert isinstance(flash_attn_ext.__version__, str)


def test_import_warns_when_sources_are_newer_than_the_build():
    """A csrc/ file changed after _C was built (an in-place / editable build, sources pulled or
    edited without a rebuild) is named at import, before a call fails with the dispatcher's
    "expected at most N argument(s)"; sources older than the build give no warning."""
    import warnings

    csrc = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(flash_attn_ext.__file__))), "csrc")
    if not os.path.isdir(csrc):
        pytest.skip("an installed package without its source tree: nothing to compare")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash_attn_ext._warn_if_sources_are_newer()  # the build under test is newer than its sources
    path = os.path.join(csrc, "flash.h")
    st = os.stat(path)
    try:
        os.utime(path, (st.st_atime, os.path.getmtime(flash_attn_ext._C.__file__) + 10))
        with pytest.warns(UserWarning, match=r"csrc/flash.h changed after the compiled extension .* rebuild"):
            flash_attn_ext._warn_if_sources_are_newer()
    finally:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_import_warns_when_built_against_another_torch():
    """`pip install .` without --no-build-isolation builds against the newest torch in a throwaway
    environment: the module then loads into another torch release, unchecked. Import says so; the
    local version part (+cpu, +cu130) is not compared, and this build's own torch gives no warning."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash_attn_ext._warn_if_torch_differs()
        flash_attn_ext._warn_if_torch_differs("2.13.0+cu130", "2.13.0+cpu")
    with pytest.warns(UserWarning, match=r"built against torch 2\.14\.1\+cu130, but torch 2\.13\.0 is imported"):
        flash_attn_ext._warn_if_torch_differs("2.14.1+cu130", "2.13.0")


@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_forward(causal, qkv_factory):
    q, k, v = qkv_factory(2, 37, 70, 4, 2, 32, torch.float32)
    torch.library.opcheck(torch.ops.flash_attn_ext.forward.default, (q, k, v, 0.2, causal))
    q, k, v = (t.detach() for t in (q, k, v))
    torch.library.opcheck(torch.ops.flash_attn_ext.forward.default, (q, k, v, 0.2, causal))


@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_backward(causal, qkv_factory):
    q, k, v = qkv_factory(2, 70, 37, 4, 1, 32, torch.float32, requires_grad=False)
    out, lse, stats = torch.ops.flash_attn_ext.forward(q, k, v, 0.2, causal)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.flash_attn_ext.backward.default, (dout, q, k, v, out, lse, 0.2, causal))
    torch.library.opcheck(torch.ops.flash_attn_ext.backward.default,
                          (dout, q, k, v, out, lse, 0.2, causal, stats))


def test_op_autograd_direct(qkv_factory):
    """torch.ops.flash_attn_ext.forward(...)[0].sum().backward() works (zero-stride dout)."""
    q, k, v = qkv_factory(1, 33, 45, 4, 2, 64, torch.float32)
    torch.ops.flash_attn_ext.forward(q, k, v, 0.125, True)[0].sum().backward()
    ref_out, _ = attention_ref(q, k, v, 0.125, causal=True)
    ref_grads = torch.autograd.grad(ref_out.sum(), (q, k, v))
    for name, t, rg in zip("qkv", (q, k, v), ref_grads):
        assert t.grad is not None and torch.isfinite(t.grad).all(), name
        torch.testing.assert_close(t.grad.double(), rg.double(), atol=2e-5, rtol=0, msg=lambda m: f"d{name}: {m}")


def test_lse_gradient_is_ignored(qkv_factory):
    q, k, v = qkv_factory(1, 16, 16, 2, 2, 32, torch.float32)
    out, lse = flash_attn_ext.flash_attn_func(q, k, v, return_lse=True)
    assert not lse.requires_grad
    out.sum().backward()


def test_default_scale_and_return_lse(qkv_factory):
    q, k, v = qkv_factory(1, 20, 30, 2, 1, 80, torch.float32, requires_grad=False)
    out = flash_attn_ext.flash_attn_func(q, k, v)
    out2, lse, _ = torch.ops.flash_attn_ext.forward(q, k, v, 1.0 / math.sqrt(80), False)
    assert torch.equal(out, out2)
    out3, lse3 = flash_attn_ext.flash_attn_func(q, k, v, return_lse=True)
    assert torch.equal(lse, lse3) and lse3.shape == (1, 2, 20) and lse3.dtype == torch.float32


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend, qkv_factory):
    """Compiles forward + loss with no graph break; AOTAutograd traces the backward through
    the fake kernels; results match eager."""
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend=backend)
    def loss_fn(q, k, v):
        out = flash_attn_ext.flash_attn_func(q, k, v, causal=True)
        return (out.float() * out.float()).sum()

    q, k, v = qkv_factory(2, 40, 56, 4, 2, 32, torch.float32)
    loss = loss_fn(q, k, v)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out = flash_attn_ext.flash_attn_func(q, k, v, causal=True)
    eager_loss = (out * out).sum()
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss)
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad)


def test_torch_compile_fullgraph_dynamic_shapes_and_scale(qkv_factory):
    """dynamic=True: symbolic shapes and a symbolic softmax_scale compile with no graph break (the
    argument checks format no message on a symbolic float), and a second shape reuses the graph."""
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, dynamic=True, backend="aot_eager")
    def loss_fn(q, k, v, scale):
        return flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=scale, causal=True).square().sum()

    for shape in ((1, 16, 16), (2, 24, 40)):
        q, k, v = qkv_factory(shape[0], shape[1], shape[2], 2, 1, 16, torch.float32)
        loss = loss_fn(q, k, v, 0.3)
        want = flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True).square().sum()
        torch.testing.assert_close(loss, want)
        grads = torch.autograd.grad(loss, (q, k, v))
        want_grads = torch.autograd.grad(want, (q, k, v))
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w)


def test_torch_compile_tensor_scale(qkv_factory):
    """A 0-dim tensor softmax_scale under torch.compile: a graph break reads it eagerly (the
    eager result); under fullgraph=True Dynamo's error names softmax_scale and asks for a float
    (it was an internal schema error: a SymFloat for the op's float argument)."""
    q, k, v = qkv_factory(2, 5, 7, 4, 2, 16, torch.float32)
    want = flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=0.3)

    def f(q, k, v, s):
        return flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=s)

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, backend="aot_eager")(q, k, v, torch.tensor(0.3)), want)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="softmax_scale is a tensor; under torch.compile pass a Python float"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, torch.tensor(0.3))


@pytest.mark.parametrize("seqlen_q,seqlen_k,causal", [(5, 7, False), (5, 7, True), (9, 4, True), (6, 6, True)])
def test_gradcheck_float64(seqlen_q, seqlen_k, causal):
    q = torch.randn(1, seqlen_q, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, seqlen_k, 1, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, seqlen_k, 1, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attn_ext.flash_attn_func(q, k, v, softmax_scale=0.5, causal=causal), (q, k, v)
    )


# ---- Non-contiguous layouts --------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bhsd_transposed_views(dtype, check_attention, poison_empty):
    """BHSD tensors transposed to BSHD views (non-contiguous, last dim contiguous)."""
    qb = torch.randn(2, 4, 70, 64, dtype=dtype, requires_grad=True)
    kb = torch.randn(2, 2, 90, 64, dtype=dtype, requires_grad=True)
    vb = torch.randn(2, 2, 90, 64, dtype=dtype, requires_grad=True)
    q, k, v = qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2)
    assert not q.is_contiguous() and q.stride(-1) == 1
    check_attention(q, k, v, causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_qkv_slices(dtype, check_attention, poison_empty):
    """q, k, v sliced from one (batch, seqlen, 3, nheads, headdim) tensor."""
    qkv = torch.randn(2, 100, 3, 4, 32, dtype=dtype, requires_grad=True)
    q, k, v = qkv.unbind(2)
    assert q.stride(1) == 3 * 4 * 32
    check_attention(q, k, v, causal=False)


def test_zero_stride_dout(qkv_factory, check_attention, poison_empty):
    """out.sum().backward() gives a dout with all-zero strides."""
    q, k, v = qkv_factory(2, 65, 130, 4, 2, 64, torch.float32)
    dout = torch.ones((), dtype=torch.float32).expand(2, 65, 4, 64)
    assert dout.stride() == (0, 0, 0, 0)
    check_attention(q, k, v, causal=True, dout=dout)
    # and through a real backward
    flash_attn_ext.flash_attn_func(q, k, v, causal=True).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_zero_length_inputs():
    def t(*shape):
        return torch.randn(*shape, requires_grad=True)

    for (b, sq, sk) in [(0, 8, 8), (2, 0, 8), (2, 0, 0)]:
        q, k, v = t(b, sq, 4, 32), t(b, sk, 2, 32), t(b, sk, 2, 32)
        out, lse, stats = torch.ops.flash_attn_ext.forward(q, k, v, 0.1, True)
        assert out.shape == q.shape and lse.shape == (b, 4, sq) and stats.shape == (2, b, 4, sq)
        out.sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape
        assert (k.grad == 0).all() and (v.grad == 0).all()
    # seqlen_k == 0: no query sees a key -> out 0, lse +inf, dq 0
    q, k, v = t(2, 5, 4, 32), t(2, 0, 2, 32), t(2, 0, 2, 32)
    out, lse, _ = torch.ops.flash_attn_ext.forward(q, k, v, 0.1, False)
    assert (out == 0).all() and torch.isposinf(lse).all()
    out.sum().backward()
    assert (q.grad == 0).all()


# ---- Friction: README install commands, example outputs (issue 11 item 8) ---------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_editable_installs_use_no_build_isolation():
    """Every `pip install ... -e` in the README (the Benchmark section's one included) builds
    against the installed torch: --no-build-isolation."""
    text = open(os.path.join(ROOT, "README.md")).read()
    installs = [ln for ln in text.splitlines() if re.search(r"pip install\b.*\s-e\s", ln)]
    assert any(".[bench]" in ln for ln in installs), "the Benchmark section's install line is gone"
    for ln in installs:
        for cmd in re.findall(r"pip install[^&#]*", ln):
            if re.search(r"\s-e\s", cmd):
                assert "--no-build-isolation" in cmd, ln


def test_train_gpt_writes_into_an_ignored_output_folder(tmp_path, monkeypatch):
    """examples/train_gpt.py wrote its CSV into the working directory; now into --out-dir
    (default train_gpt_out/, ignored by git)."""
    spec = importlib.util.spec_from_file_location("train_gpt", os.path.join(ROOT, "examples", "train_gpt.py"))
    train_gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_gpt)
    args = train_gpt.parse_args([])
    assert args.out_dir == "train_gpt_out" and args.csv == "losses.csv"
    ignored = [ln.strip() for ln in open(os.path.join(ROOT, ".gitignore"))]
    assert "train_gpt_out/" in ignored
    if not all(os.path.isfile(os.path.join(train_gpt.TEXT_DIR, f)) for f in train_gpt.TEXT_FILES):
        pytest.skip(f"the Debian license texts in {train_gpt.TEXT_DIR} are not on this machine")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "runs" / "a"
    train_gpt.main(["--device", "cpu", "--steps", "2", "--tiny", "--attn", "flash_attn_ext",
                    "--eval-batches", "1", "--out-dir", str(out)])
    assert (out / "losses.csv").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]   # nothing in the cwd


def test_raw_ops_are_documented():
    """help(torch.ops.flash_attn_ext.forward) says the shapes, units and outputs."""
    fwd, bwd = torch.ops.flash_attn_ext.forward, torch.ops.flash_attn_ext.backward
    for op in (fwd, fwd.default):
        assert all(w in op.__doc__ for w in ("softmax_lse", "natural log", "softmax_stats", "(batch, seqlen_q, nheads, headdim)"))
    for op in (bwd, bwd.default):
        assert all(w in op.__doc__ for w in ("dq, dk, dv", "softmax_stats", "deterministic"))
