"""CUDA backward kernels (csrc/kernels/dispatch.cu, csrc/kernels/{sm80,sm90}/flash_bwd_*.cuh):
FlashAttention-2 Alg. 2 (Dao 2023) split into preprocess, dK/dV and dQ kernels.

Every test runs once per backward arch path the GPU can take: "auto" (what the dispatch picks: the
sm90 wgmma kernels on an sm_90 GPU for the head dims they cover, sm80 otherwise) and, on sm_90
with a build that has sm_90a code, "sm80" (flash_attn_ext.force_sm80_path forces the mma.sync path).

dq, dk, dv are checked against the autograd of flash_attn_ext.reference.attention_ref with the
accuracy rule of tests/accuracy.py (max|ours - ref| <= 2 * max|same-dtype torch - ref|, ref in
float64), through the op directly (torch.ops.flash_attn_ext.backward with the forward's out and
softmax_lse) and through autograd of torch.ops.flash_attn_ext.forward. Outputs are poisoned (NaN
fill of torch.empty) so an unwritten element fails.
"""

import json
import math
import os
import re
import subprocess
import sys
import threading

import pytest
import torch

import flash_attn_ext  # noqa: F401  (registers torch.ops.flash_attn_ext)
from accuracy import check_accuracy
from conftest import require_hdim
from flash_attn_ext.reference import attention_ref
from long_keys import check_long_key_grads, inputs_past_2pow31, long_key_inputs, require_free_gib

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="the CUDA backward kernels need an NVIDIA GPU (sm_80 or newer)")

DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def bwd_path(arch_path):
    """Runs the test on every arch path the GPU can take (conftest.py: arch_path)."""
    return arch_path


def _rand(*shape, dtype):
    return torch.randn(*shape, dtype=dtype, device="cuda")


def _qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, layout="bshd"):
    """q, k, v in the requested memory layout (always BSHD-shaped views, last dim contiguous):
    bshd: contiguous; bhsd: transposed views of (b, h, s, d) tensors; qkv_slice: q/k/v are slices
    of one fused (b, s, h + 2 h_k, d + 8) tensor (row/head strides not of the plain shape)."""
    if layout == "bshd":
        return (_rand(batch, seqlen_q, nheads, headdim, dtype=dtype),
                _rand(batch, seqlen_k, nheads_k, headdim, dtype=dtype),
                _rand(batch, seqlen_k, nheads_k, headdim, dtype=dtype))
    if layout == "bhsd":
        return (_rand(batch, nheads, seqlen_q, headdim, dtype=dtype).transpose(1, 2),
                _rand(batch, nheads_k, seqlen_k, headdim, dtype=dtype).transpose(1, 2),
                _rand(batch, nheads_k, seqlen_k, headdim, dtype=dtype).transpose(1, 2))
    assert layout == "qkv_slice" and seqlen_q == seqlen_k
    fused = _rand(batch, seqlen_q, nheads + 2 * nheads_k, headdim + 8, dtype=dtype)
    q = fused[:, :, :nheads, :headdim]
    k = fused[:, :, nheads:nheads + nheads_k, :headdim]
    v = fused[:, :, nheads + nheads_k:, :headdim]
    return q, k, v


def _reference_grads(q, k, v, dout, causal, softmax_scale):
    """(ref grads in float64, baseline grads in q's dtype) of attention_ref for upstream dout."""
    grads = []
    for upcast in (True, False):
        qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        out, _ = attention_ref(qr, kr, vr, softmax_scale, causal, upcast=upcast)
        out.backward(dout.to(out.dtype))
        grads.append((qr.grad, kr.grad, vr.grad))
    return grads


def _flash_bwd(q, k, v, dout, causal, softmax_scale):
    """Forward op for out / softmax_lse, then the backward op directly."""
    out, lse, stats = torch.ops.flash_attn_ext.forward(q, k, v, softmax_scale, causal)
    return torch.ops.flash_attn_ext.backward(dout, q, k, v, out, lse, softmax_scale, causal, stats)


def _check_grads(q, k, v, dout, causal, grads):
    scale = 1.0 / math.sqrt(q.shape[-1])
    ref, base = _reference_grads(q, k, v, dout, causal, scale)
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, ref, base):
        assert g.shape == r.shape and g.dtype == q.dtype, f"{name}: {g.shape} {g.dtype}"
        check_accuracy(name, g, r, b)


SEQLENS = [(1, 1), (17, 128), (128, 255), (255, 17), (1000, 1000), (2048, 1000)]


@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [32, 64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_backward_accuracy(dtype, headdim, causal, seqlens, poison_empty):
    """dq, dk, dv over the forward's grid (hdim 80 runs padded to 96 inside the kernel)."""
    require_hdim(headdim)
    seqlen_q, seqlen_k = seqlens
    batch, nheads = (2, 2) if seqlen_q * seqlen_k <= 10**6 else (1, 2)
    q, k, v = _qkv(batch, seqlen_q, seqlen_k, nheads, nheads, headdim, dtype)
    dout = _rand(*q.shape, dtype=dtype)
    grads = _flash_bwd(q, k, v, dout, causal, 1.0 / math.sqrt(headdim))
    _check_grads(q, k, v, dout, causal, grads)


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "qkv_slice"])
@pytest.mark.parametrize("seqlens", [(255, 255), (1000, 1000), (300, 1000), (1000, 300)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_backward_gqa_layouts(dtype, headdim, causal, seqlens, layout, poison_empty):
    """GQA 4:1 (dK/dV sum over the 4 query heads of a group) with non-contiguous q/k/v views."""
    require_hdim(headdim)
    seqlen_q, seqlen_k = seqlens
    if layout == "qkv_slice" and seqlen_q != seqlen_k:
        pytest.skip("a fused qkv tensor has one sequence length")
    q, k, v = _qkv(2, seqlen_q, seqlen_k, 8, 2, headdim, dtype, layout)
    dout = _rand(2, 8, seqlen_q, headdim, dtype=dtype).transpose(1, 2)  # non-contiguous dout too
    grads = _flash_bwd(q, k, v, dout, causal, 1.0 / math.sqrt(headdim))
    _check_grads(q, k, v, dout, causal, grads)


@pytest.mark.parametrize("nheads_k", [8, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_backward_autograd(dtype, nheads_k, poison_empty):
    """Autograd through torch.ops.flash_attn_ext.forward (ops.py wiring) gives the op's grads."""
    require_hdim(128)
    q, k, v = (t.requires_grad_(True) for t in _qkv(2, 700, 900, 8, nheads_k, 128, dtype))
    scale = 1.0 / math.sqrt(128)
    out = torch.ops.flash_attn_ext.forward(q, k, v, scale, True)[0]
    dout = _rand(*out.shape, dtype=dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    direct = _flash_bwd(q.detach(), k.detach(), v.detach(), dout, True, scale)
    for g, d in zip(grads, direct):
        assert torch.equal(g, d)
    _check_grads(q.detach(), k.detach(), v.detach(), dout, True, grads)


@pytest.mark.parametrize("headdim", [128, 256])  # the rows and the roles kernels on sm_90
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_backward_deterministic(dtype, headdim):
    """No atomics: two runs are bitwise equal (GQA 4:1, causal, ragged lengths)."""
    require_hdim(headdim)
    q, k, v = _qkv(2, 1000, 1100, 8, 2, headdim, dtype)
    dout = _rand(*q.shape, dtype=dtype)
    scale = 1.0 / math.sqrt(headdim)
    out, lse, stats = torch.ops.flash_attn_ext.forward(q, k, v, scale, True)
    first = torch.ops.flash_attn_ext.backward(dout, q, k, v, out, lse, scale, True, stats)
    for _ in range(2):
        again = torch.ops.flash_attn_ext.backward(dout, q, k, v, out, lse, scale, True, stats)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} differs between runs"


_SEQUENTIAL_BWD_SCRIPT = """
import sys, torch, flash_attn_ext
if sys.argv[3] == "sm80":
    flash_attn_ext.force_sm80_path(True)
dout, q, k, v, out, lse, stats = torch.load(sys.argv[1])
torch.save(torch.ops.flash_attn_ext.backward(dout, q, k, v, out, lse, float(sys.argv[4]), True, stats), sys.argv[2])
"""


def _concurrent_case(headdim):
    """GQA 4:1, causal, ragged lengths: the inputs of one backward call, and its scale."""
    q, k, v = _qkv(2, 1000, 1100, 8, 2, headdim, torch.bfloat16)
    dout = _rand(*q.shape, dtype=torch.bfloat16)
    scale = 1.0 / math.sqrt(headdim)
    out, lse, stats = torch.ops.flash_attn_ext.forward(q, k, v, scale, True)
    return (dout, q, k, v, out, lse, stats), scale


def _backward(args, scale):
    dout, q, k, v, out, lse, stats = args
    return torch.ops.flash_attn_ext.backward(dout, q, k, v, out, lse, scale, True, stats)


def _concurrent():
    """Whether the backward's kernels run side by side here (FLASH_ATTN_EXT_BWD_CONCURRENT)."""
    return os.environ.get("FLASH_ATTN_EXT_BWD_CONCURRENT") != "0"


def _require_concurrent():
    if not _concurrent():
        pytest.skip("FLASH_ATTN_EXT_BWD_CONCURRENT=0 runs the backward's kernels in sequence")


@pytest.mark.parametrize("headdim", [64, 128])
def test_backward_concurrent_kernels_match_sequential(headdim, arch_path, tmp_path):
    """The dK/dV and dQ kernels run side by side (dQ on a side stream forked after the preprocess,
    kernels/bwd_fork.h: BwdFork); in a subprocess with FLASH_ATTN_EXT_BWD_CONCURRENT=0 they run
    one after the other: the same bits."""
    require_hdim(headdim)
    _require_concurrent()
    args, scale = _concurrent_case(headdim)
    torch.save(args, tmp_path / "in.pt")
    env = dict(os.environ, FLASH_ATTN_EXT_BWD_CONCURRENT="0")
    r = subprocess.run([sys.executable, "-c", _SEQUENTIAL_BWD_SCRIPT, str(tmp_path / "in.pt"), str(tmp_path / "out.pt"),
                        arch_path, repr(scale)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    sequential = torch.load(tmp_path / "out.pt")
    for name, a, b in zip(("dq", "dk", "dv"), _backward(args, scale), sequential):
        assert torch.equal(a, b), f"{name}: concurrent and sequential kernels differ"


def test_backward_concurrent_kernels_run_on_side_streams(tmp_path):
    """In a profiler trace (kernel events carry their stream): each backward call's dQ kernel runs
    on another stream than its dK/dV kernel, and calls from one thread on two caller streams get
    two side streams (one per caller stream: a call's dQ never waits for another stream's work)."""
    require_hdim(128)
    _require_concurrent()
    args, scale = _concurrent_case(128)
    callers = [torch.cuda.Stream(), torch.cuda.Stream()]
    for stream in callers:  # first use of each caller stream: its side stream is made
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _backward(args, scale)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for stream in callers:
            with torch.cuda.stream(stream):
                _backward(args, scale)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    with open(tmp_path / "trace.json") as f:
        kernels = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    dkv = [e["args"]["stream"] for e in kernels if "flash_bwd_dkv" in e["name"]]
    dq = [e["args"]["stream"] for e in kernels if "flash_bwd_dq" in e["name"]]
    assert len(dkv) == 2 and len(dq) == 2, [e["name"] for e in kernels]
    assert len(set(dkv)) == 2 and len(set(dq)) == 2 and not set(dq) & set(dkv), (dkv, dq)


def _graph_dkv_dq_parallel(dot_path):
    """From a CUDA graph's DOT dump (cudaGraphDebugDotPrint: one node per kernel, named in its
    label; edges "a" -> "b"): whether the graph's dK/dV and dQ kernel nodes exist and neither is
    reachable from the other (side by side, not in sequence)."""
    with open(dot_path) as f:
        text = f.read()
    nodes = {m.group(1): m.group(2) for m in re.finditer(r'^\s*"([^"]+)"\s*\[(.*?)\];', text, re.S | re.M)}
    edges = {}
    for a, b in re.findall(r'"([^"]+)"\s*->\s*"([^"]+)"', text):
        edges.setdefault(a, set()).add(b)

    def reachable(src, dst):
        seen, todo = set(), [src]
        while todo:
            n = todo.pop()
            if n == dst:
                return True
            if n not in seen:
                seen.add(n)
                todo.extend(edges.get(n, ()))
        return False

    dkv = [n for n, label in nodes.items() if "flash_bwd_dkv" in label]
    dq = [n for n, label in nodes.items() if "flash_bwd_dq" in label]
    assert len(dkv) == 1 and len(dq) == 1, (dkv, dq, text[:2000])
    return not reachable(dkv[0], dq[0]) and not reachable(dq[0], dkv[0])


def _dumpable_graph():
    """A CUDAGraph whose captured graph stays alive for debug_dump: newer torch (2.11 here) frees
    it at capture end unless made with keep_graph=True (then instantiated on its first replay;
    debug mode alone writes no file there); older torch keeps it in debug mode."""
    try:
        graph = torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        graph = torch.cuda.CUDAGraph()
    graph.enable_debug_mode()
    return graph


def _dump_graph(graph, path):
    """graph's DOT dump at path (asserting it was written: debug_dump only warns when it is not)."""
    graph.debug_dump(str(path))
    assert path.exists(), f"CUDAGraph.debug_dump wrote no {path}"
    return path


def test_backward_concurrent_kernels_streams_graphs_threads(tmp_path):
    """The fork and join of the dQ side stream (kernels/bwd_fork.h: BwdFork) on a caller's
    non-default stream, inside a CUDA graph captured on that stream after an eager warm-up there
    (its dK/dV and dQ kernel nodes on parallel branches; replayed twice), in a fresh host thread
    whose first backward is inside a capture (its side stream made during the capture: parallel
    branches too), and from four host threads at once on their own streams (each has its own side
    streams and events): every result bit for bit the eager one's."""
    require_hdim(128)
    args, scale = _concurrent_case(128)
    ref = _backward(args, scale)

    def same(got):
        return all(torch.equal(a, b) for a, b in zip(ref, got))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm = _backward(args, scale)  # graph capture's warm-up, on a non-default stream
    torch.cuda.current_stream().wait_stream(side)
    assert same(warm)
    graph = _dumpable_graph()
    with torch.cuda.graph(graph, stream=side):  # the warmed-up stream: its side stream exists
        captured = _backward(args, scale)
    dot = _dump_graph(graph, tmp_path / "graph.dot")
    if _concurrent():
        assert _graph_dkv_dq_parallel(dot), "the captured dK/dV and dQ kernels are in sequence"
    for _ in range(2):
        for t in captured:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert same(captured)

    results, errors = {}, []

    def capture_first():
        try:
            g, stream = _dumpable_graph(), torch.cuda.Stream()
            with torch.cuda.stream(stream), torch.cuda.graph(g, stream=stream):
                got = _backward(args, scale)
            dot = _dump_graph(g, tmp_path / "graph_first.dot")
            g.replay()
            torch.cuda.synchronize()
            results["capture_first"] = same(got) and (not _concurrent() or _graph_dkv_dq_parallel(dot))
        except Exception as e:  # noqa: BLE001  (reported by the assert below)
            errors.append(repr(e))

    def many_calls(i):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                outs = [_backward(args, scale) for _ in range(10)]
            stream.synchronize()
            results[i] = all(same(o) for o in outs)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    thread = threading.Thread(target=capture_first)
    thread.start()
    thread.join()
    threads = [threading.Thread(target=many_calls, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == {"capture_first": True, 0: True, 1: True, 2: True, 3: True}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_backward_load_paths_agree(dtype, headdim, causal, poison_empty):
    """The sm90 backward kernels stream their tiles by TMA for inputs TMA can describe and by
    cp.async for the rest (kernels/sm90/smem_layout.cuh: BwdStages); both give the same bits. A
    dout broadcast over heads (head stride 0) sends the dK/dV kernel to cp.async, K/V broadcast
    over the batch (batch stride 0) the dQ kernel; their contiguous copies take TMA. GQA 2:1,
    ragged lengths."""
    require_hdim(headdim)
    q = _rand(2, 333, 4, headdim, dtype=dtype)
    k1, v1 = _rand(1, 257, 2, headdim, dtype=dtype), _rand(1, 257, 2, headdim, dtype=dtype)
    dout1 = _rand(2, 333, 1, headdim, dtype=dtype)
    scale = 1.0 / math.sqrt(headdim)
    k, v, dout = k1.expand(2, -1, -1, -1), v1.expand(2, -1, -1, -1), dout1.expand(-1, -1, 4, -1)
    assert k.stride(0) == 0 and dout.stride(2) == 0
    # One forward for both (a zero-stride K/V would send the forward to another kernel as well).
    kd, vd, doutd = k.contiguous(), v.contiguous(), dout.contiguous()
    out, lse, stats = torch.ops.flash_attn_ext.forward(q, kd, vd, scale, causal)
    bwd = torch.ops.flash_attn_ext.backward
    strided = bwd(dout, q, k, v, out, lse, scale, causal, stats)
    dense = bwd(doutd, q, kd, vd, out, lse, scale, causal, stats)
    for name, a, b in zip(("dq", "dk", "dv"), strided, dense):
        assert torch.equal(a, b), f"{name}: the cp.async and TMA loads disagree"
    _check_grads(q, kd, vd, doutd, causal, dense)


@pytest.mark.parametrize("headdim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_backward_rows_without_keys(dtype, headdim, poison_empty):
    """Causal with seqlen_q > seqlen_k: query rows i < seqlen_q - seqlen_k see no key. Their dq is
    exactly 0, nothing is NaN, and the rest still meets the accuracy rule."""
    require_hdim(headdim)
    seqlen_q, seqlen_k = 300, 100
    q, k, v = _qkv(2, seqlen_q, seqlen_k, 4, 2, headdim, dtype)
    dout = _rand(*q.shape, dtype=dtype)
    dq, dk, dv = _flash_bwd(q, k, v, dout, True, 1.0 / math.sqrt(headdim))
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(g).any(), f"{name} has NaN"
    blind = seqlen_q - seqlen_k
    assert torch.equal(dq[:, :blind], torch.zeros_like(dq[:, :blind]))
    assert dq[:, blind:].abs().amax() > 0
    _check_grads(q, k, v, dout, True, (dq, dk, dv))


def test_backward_tensors_over_2pow31_elements(poison_empty):
    """k, v, dk and dv of > 2^31 elements each (bf16, ~4.3 GB each): 64-bit offsets in the
    preprocess, dK/dV and dQ kernels. Each query row's key of most weight lies past element 2^31
    (tests/long_keys.py), with probability ~0.9 (median; a few % to ~1 over the rows, sampled)
    rather than all of it, so that dK, dQ and dV there all depend on the keys read: a key that
    takes a row's whole probability has dS = P (dP - D) ~ 0, and a zeroed dK or a dQ without those
    keys would pass (tried on the CPU op). The references are computed one key chunk at a time."""
    require_hdim(128)
    q, k, v = inputs_past_2pow31(32, dominance=1.3)  # the key's score ~15 against ~132k keys
    dout = _rand(*q.shape, dtype=q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1])
    dq, dk, dv = _flash_bwd(q, k, v, dout, False, scale)
    check_long_key_grads(q, k, v, dout, scale, dq, dk, dv)


def test_backward_long_rows(poison_empty):
    """Rows of 2^20 keys (8 heads; every value row shifted by 2, so |D| = |rowsum(dO o O)| is large):
    the forward moves O out of the tensor cores' accumulator every 8192 keys
    (kernels/common/long_rows.cuh). Without that the accumulator's rounding toward zero left O low
    by ~N / 16 * 2^-25 and D carried it into dq and dk: 3.8x and 3.7x the same-dtype baseline's
    error on an H100, both arch paths (docs/PERF_NOTES.md, forty-first session)."""
    require_hdim(128)
    require_free_gib(20)
    q, k, v = long_key_inputs(1 << 20, nheads=8, dominance=1.5, shifted_rows=1 << 20)
    dout = _rand(*q.shape, dtype=q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1])
    dq, dk, dv = _flash_bwd(q, k, v, dout, False, scale)
    check_long_key_grads(q, k, v, dout, scale, dq, dk, dv)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_backward_large_dout(dtype, headdim, causal, poison_empty):
    """dout scaled by 2^12, as fp16 loss scaling does (|dout| <= 4 * 2^12, representable): dP - D
    (|dP| up to ~1e5) leaves fp16's range while every gradient stays representable (near-uniform
    P <= 1/257: seqlen_k - seqlen_q = 256 keys are visible to every row, and the causal mask zeroes
    the rest). The backward is linear in dout, so grads / 2^12 must meet the accuracy rule of the
    unscaled problem. A kernel that rounds dP - D to fp16 before multiplying by P gets inf there,
    and 0 * inf = NaN on masked pairs."""
    require_hdim(headdim)
    q, k, v = _qkv(2, 128, 384, 2, 2, headdim, dtype)
    q, k = q * 0.1, k * 0.1
    dout = _rand(*q.shape, dtype=dtype).clamp(-4, 4)
    loss_scale = 2.0 ** 12
    grads = _flash_bwd(q, k, v, dout * loss_scale, causal, 1.0 / math.sqrt(headdim))
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert torch.isfinite(g).all(), f"{name}: inf or NaN with dout * 2^12"
    _check_grads(q, k, v, dout, causal, tuple(g / loss_scale for g in grads))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_backward_zero_stride_dout(dtype, causal, poison_empty):
    """out.sum().backward(): autograd hands the backward an all-zero-stride dout (expanded ones)."""
    require_hdim(64)
    q, k, v = (t.requires_grad_(True) for t in _qkv(2, 333, 257, 4, 4, 64, dtype))
    scale = 1.0 / math.sqrt(64)
    out = torch.ops.flash_attn_ext.forward(q, k, v, scale, causal)[0]
    out.sum().backward()
    dout = torch.ones(1, dtype=dtype, device="cuda").expand(q.shape)
    assert dout.stride() == (0, 0, 0, 0)
    direct = _flash_bwd(q.detach(), k.detach(), v.detach(), dout, causal, scale)
    for g, d in zip((q.grad, k.grad, v.grad), direct):
        assert torch.equal(g, d)
    _check_grads(q.detach(), k.detach(), v.detach(), dout, causal, direct)
    # stride(-1) == 1 with every other stride 0 reaches the kernels without a copy.
    dout = _rand(1, 1, 1, 64, dtype=dtype).expand(q.shape)
    assert dout.stride() == (0, 0, 0, 1)
    grads = _flash_bwd(q.detach(), k.detach(), v.detach(), dout, causal, scale)
    _check_grads(q.detach(), k.detach(), v.detach(), dout, causal, grads)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_backward_noncontiguous_dout(dtype, poison_empty):
    """dout a strided slice (row stride != nheads * headdim) and a broadcast over heads."""
    require_hdim(128)
    q, k, v = _qkv(2, 200, 300, 4, 4, 128, dtype)
    wide = _rand(2, 200, 4, 136, dtype=dtype)
    for dout in (wide[..., :128], _rand(2, 200, 1, 128, dtype=dtype).expand(2, 200, 4, 128)):
        assert not dout.is_contiguous()
        grads = _flash_bwd(q, k, v, dout, False, 1.0 / math.sqrt(128))
        _check_grads(q, k, v, dout, False, grads)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_many_heads(causal, poison_empty):
    """batch * nheads = 70,000 > 65,535: the 1-D grids cover every (batch, head)."""
    require_hdim(64)
    dtype = torch.bfloat16
    q, k, v = _qkv(4375, 9, 7, 16, 16, 64, dtype)
    dout = _rand(*q.shape, dtype=dtype)
    grads = _flash_bwd(q, k, v, dout, causal, 0.125)
    ref, base = _reference_grads(q, k, v, dout, causal, 0.125)
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, ref, base):
        check_accuracy(name, g, r, b)
    # The last (batch, head) pairs are written too (a 16-bit grid dimension would miss them).
    assert grads[2][-1].abs().amax() > 0 and grads[0][-1, -1].abs().amax() > 0


# ---- The long-query dK/dV rows (sm90/tile_config.h: DkvLongTile, chosen by dkv_long_rows): calls
# whose sequences hold at least 4096 (d64, d96) or 8192 (d128) queries and keys on average (dense:
# seqlen_q / seqlen_k; varlen: total / batch) run the sm90 dK/dV kernel on 128-key tiles (d64,
# d128: two warpgroups per CTA sharing each Q / dO tile) or 192-key tiles (d96: three warpgroups,
# P^T through shared memory) instead of DkvTile's 64-key tiles; d96 calls from 2048 that the long
# row does not take (shorter, a smaller grid, soft-capping or dropout: no such long-row twins) run
# the middle-length row (DkvMidTile: 128-key tiles on two warpgroups) where its own grid has >= 2
# CTAs per SM. Every K row's sum over the Q tiles keeps its order, and d96's three rows form dS^T
# from the same P^T (the rounded one but in the soft-capping and dropout twins), so the rows give
# the same bits: a packed call whose means fall on the other side of the minimum is the dense
# call's bitwise twin (the varlen kernels equal the dense ones bit for bit:
# tests/test_varlen_cuda.py).


def _sm90_rows(fn, kernel):
    """The tile rows (their struct names: DkvTile, DkvLongTile, DkvMidTile, DqTile, DqShortTile) of the sm90
    `kernel` ("flash_bwd_dkv" or "flash_bwd_dq") launches of fn(), from the torch.profiler kernel
    names, which carry the row's type; empty on the sm80 path."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if f"{kernel}_" in e.name and "sm90" in e.name]
    # The row's template argument, demangled ("DkvTile<128>") or not ("7DkvTileILi128E").
    return {re.search(r"(DkvLongTile|DkvMidTile|DkvTile|DqShortTile|DqTile)(?=<|I)", n).group(1) for n in names}


def _sm90_backward_runs(path):
    """Whether the dispatch runs the sm90 backward kernels on this GPU and arch path."""
    return (path == "auto" and torch.cuda.get_device_capability() == (9, 0)
            and "90a" in str(flash_attn_ext.build_info().get("cuda_archs", "")))


def _packed(t):
    """(batch, seqlen, heads, d) -> (batch * seqlen, heads, d)"""
    return t.reshape(-1, *t.shape[2:])


def _varlen_backward_of_dense(groups, scale, causal):
    """One varlen backward over every sequence of `groups`, each (q, k, v, dout, out, lse, stats)
    of a dense batch (the dense forward's outputs, so the backward's inputs are the dense calls'),
    packed in order; returns the packed (dq, dk, dv)."""
    cat = lambda i: torch.cat([_packed(g[i]) for g in groups])
    lens_q = [g[0].shape[1] for g in groups for _ in range(g[0].shape[0])]
    lens_k = [g[1].shape[1] for g in groups for _ in range(g[0].shape[0])]
    cu = lambda lens: torch.tensor([0] + lens, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)
    lse = torch.cat([g[5].transpose(0, 1).reshape(g[5].shape[1], -1) for g in groups], dim=1)
    stats = torch.cat([g[6].transpose(1, 2).reshape(2, g[5].shape[1], -1) for g in groups], dim=2)
    return torch.ops.flash_attn_ext.varlen_backward(
        cat(3), cat(0), cat(1), cat(2), cat(4), lse, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), scale,
        causal, stats)


def _dense_backward_rows(b, sq, sk, nheads, nheads_k, headdim, dtype, scale, causal, kernel):
    """A dense forward + backward through the ops on fresh inputs: ((q, k, v, dout, out, lse,
    stats), (dq, dk, dv), the tile rows of the backward's `kernel` launches: _sm90_rows)."""
    ops = torch.ops.flash_attn_ext
    q, k, v = _qkv(b, sq, sk, nheads, nheads_k, headdim, dtype)
    dout = _rand(*q.shape, dtype=dtype)
    out, lse, stats = ops.forward(q, k, v, scale, causal)
    grads = []
    rows = _sm90_rows(lambda: grads.extend(ops.backward(dout, q, k, v, out, lse, scale, causal, stats)), kernel)
    return (q, k, v, dout, out, lse, stats), grads, rows


# (batch, nheads, nheads_k, seqlen_q, seqlen_k): the long row where both lengths are at least the head
# dim's minimum (dkv_long_min_seqlen: d64 4096, d96 4096, d128 8192) and its grid has >= 2 CTAs per
# SM (ceil(seqlen_k / kBlockN) * batch * nheads_k, kBlockN 128, d96 192), else at d96 the middle
# row from 2048 (kBlockN 128); 8192 x 8200 (causal offset 8) and 8400 x 8192 (offset -208) make the
# CTA's upper 64 key rows visit one fully masked Q tile more than its lower ones; 8000 x 9000 is too
# short at d128, 4000 x 4100 at d64 and d96 (4100 x 4096 is not; d96: the middle row), 2040 x 2100
# for d96's middle row (2048 x 2100 is not: 272 middle CTAs); batch 1 MQA at 8192 keys has 64 (d96:
# 43 long, 64 middle) CTAs: the short row.
LONG_ROW_CASES = [(2, 8, 4, 8192, 8192), (2, 8, 4, 8192, 8200), (2, 8, 4, 8400, 8192), (2, 8, 4, 8000, 9000),
                  (1, 2, 1, 8192, 8192), (4, 8, 4, 4100, 4096), (4, 8, 4, 4000, 4100), (4, 8, 4, 2048, 2100),
                  (4, 8, 4, 2040, 2100)]


def _dkv_row(headdim, mean_seqlen_q, mean_seqlen_k, batch_kv_heads, num_sms, softcap_or_dropout=False):
    """The sm90 dK/dV row dispatch.cu picks ("DkvLongTile", "DkvMidTile" or "DkvTile"), restated:
    sm90/tile_config.h's dkv_long_rows with DkvLongTile's numbers (dkv_long_min_seqlen, kBlockN),
    d96's long row taking no soft-capping or dropout call, then at d96 with DkvMidTile's (2048, 128
    keys), and the knob (both off)."""
    def rule(min_seqlen, block_n):
        ctas = -(-mean_seqlen_k // block_n) * batch_kv_heads
        return min(mean_seqlen_q, mean_seqlen_k) >= min_seqlen and ctas >= 2 * num_sms
    if os.environ.get("FLASH_ATTN_EXT_SM90_BWD_LONG_ROWS") == "0":
        return "DkvTile"
    if rule({64: 4096, 96: 4096}.get(headdim, 8192), 192 if headdim == 96 else 128) and not (
            headdim == 96 and softcap_or_dropout):
        return "DkvLongTile"
    return "DkvMidTile" if headdim == 96 and rule(2048, 128) else "DkvTile"


@pytest.mark.parametrize("case", LONG_ROW_CASES, ids=lambda c: "b{}h{}hk{}_{}x{}".format(*c))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [64, 96, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_backward_long_query_rows(dtype, headdim, causal, case, bwd_path, poison_empty):
    """GQA 2:1: the dispatch takes the long-query (or d96's middle-length) dK/dV row exactly where
    dkv_long_rows says (dense: seqlen_q and seqlen_k), its gradients are within the rule (d96 / d128:
    the first case), and where it took the long or middle row they are the bits of the same
    sequences in a varlen call packed with short ones (the means below the minimum: the short row)."""
    require_hdim(headdim, exact=True)
    if bwd_path == "sm80":
        pytest.skip("the long-query row is a row of the sm90 dK/dV kernel")
    batch, nheads, nheads_k, seqlen_q, seqlen_k = case
    scale = 1.0 / math.sqrt(headdim)  # _check_grads' scale
    dense_call = lambda b, sq, sk: _dense_backward_rows(b, sq, sk, nheads, nheads_k, headdim, dtype, scale, causal,
                                                        "flash_bwd_dkv")

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    sm90 = _sm90_backward_runs(bwd_path)
    expect = lambda *means: {_dkv_row(headdim, *means, num_sms)} if sm90 else set()
    group, dense, rows = dense_call(batch, seqlen_q, seqlen_k)
    assert rows == expect(seqlen_q, seqlen_k, batch * nheads_k), rows
    if headdim == 64 or case == LONG_ROW_CASES[0]:
        _check_grads(*group[:4], causal, dense)
    if rows in ({"DkvTile"}, set()):
        return

    # The same sequences packed with 16 short ones (a varlen call decides by total / batch), on the
    # dense forward's out, softmax_lse and softmax_stats: the short row, the same bits.
    other, _, _ = dense_call(16, 136, 136)
    seqs = batch + 16
    varlen = []
    varlen_rows = _sm90_rows(lambda: varlen.extend(_varlen_backward_of_dense([group, other], scale, causal)),
                             "flash_bwd_dkv")
    assert varlen_rows == expect((batch * seqlen_q + 16 * 136) // seqs, (batch * seqlen_k + 16 * 136) // seqs,
                                 seqs * nheads_k) == {"DkvTile"}, varlen_rows
    rows_q, rows_k = batch * seqlen_q, batch * seqlen_k
    for name, a, b, n in zip(("dq", "dk", "dv"), dense, varlen, (rows_q, rows_k, rows_k)):
        assert torch.equal(_packed(a), b[:n]), f"{name}: the {rows} row and the short row disagree"


@pytest.mark.parametrize("headdim, lens", [(64, (4096, 4200)), (96, (4096, 4200)), (96, (2048, 2100)),
                                           (128, (8192, 8300))], ids=["d64", "d96", "d96_mid", "d128"])
def test_backward_long_rows_varlen(headdim, lens, bwd_path, poison_empty):
    """A varlen call of long sequences takes the long-query (d96 at 2048: the middle-length) dK/dV
    row by its means (two sequences at and past the minimum, 16 / 8 heads: 272-1040 CTAs), with the
    bits of the same sequences alone (on 132 SMs each alone has fewer than 2 CTAs of the row per SM
    and runs the short row, but d96's 4200 x 4200: the middle-length row, 264 CTAs)."""
    require_hdim(headdim, exact=True)
    if bwd_path == "sm80":
        pytest.skip("the long-query row is a row of the sm90 dK/dV kernel")
    scale, causal = 1.0 / math.sqrt(headdim), True
    groups, dense = [], []
    for n in lens:
        group, grads, _ = _dense_backward_rows(1, n, n, 16, 8, headdim, torch.bfloat16, scale, causal, "flash_bwd_dkv")
        groups.append(group)
        dense.append(grads)
    varlen = []
    rows = _sm90_rows(lambda: varlen.extend(_varlen_backward_of_dense(groups, scale, causal)), "flash_bwd_dkv")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    expected = {_dkv_row(headdim, sum(lens) // 2, sum(lens) // 2, 2 * 8, num_sms)}
    assert rows == (expected if _sm90_backward_runs(bwd_path) else set()), rows
    for i, name in enumerate(("dq", "dk", "dv")):
        assert torch.equal(torch.cat([_packed(g[i]) for g in dense]), varlen[i]), f"{name}: packed and alone disagree"


_KNOB_OFF_TWIN_SCRIPT = """
import sys, torch, flash_attn_ext
q, k, v, dout, kwargs = torch.load(sys.argv[1])
q, k, v = (t.requires_grad_() for t in (q, k, v))
torch.manual_seed(0)  # the dropout call's rng_state, as in the test
torch.save(torch.autograd.grad(flash_attn_ext.flash_attn_func(q, k, v, **kwargs), (q, k, v), dout), sys.argv[2])
"""


@pytest.mark.parametrize("seqlen", [2048, 4096])
@pytest.mark.parametrize("twin", ["plain", "window", "alibi", "softcap", "dropout"])
def test_backward_long_rows_d96_twins(twin, seqlen, bwd_path, tmp_path, poison_empty):
    """d96's dK/dV rows per twin: from 4096 queries and keys the long row (192 keys, three
    warpgroups) runs the plain, window and ALiBi calls, but has no soft-capping and dropout twins
    (they spill or serialize on three warpgroups); from 2048 the middle-length row (128 keys, two
    warpgroups) runs the others, soft-capping and dropout at any length (dispatch.cu). Each call
    gives the bits of the same call on DkvTile (a subprocess with FLASH_ATTN_EXT_SM90_BWD_LONG_ROWS=0,
    read once per process; the same rng_state). 4 x 2048 or 2 x 4096, 16 / 8 heads: 512 middle
    CTAs, 352 long ones at 4096, >= 2 per SM up to 176 SMs."""
    require_hdim(96, exact=True)
    if bwd_path == "sm80":
        pytest.skip("the long-query rows are rows of the sm90 dK/dV kernel")
    batch = 4 if seqlen == 2048 else 2
    q, k, v = _qkv(batch, seqlen, seqlen, 16, 8, 96, torch.bfloat16)
    kwargs = {"plain": {}, "window": {"window_size": (300, 100)}, "softcap": {"softcap": 5.0},
              "dropout": {"dropout_p": 0.17},
              "alibi": {"alibi_slopes": torch.rand(batch, 16, device="cuda", dtype=torch.float32) * 0.1}}[twin]
    dout = _rand(*q.shape, dtype=q.dtype)
    torch.save((q, k, v, dout, kwargs), tmp_path / "in.pt")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    grads = []

    def call():
        torch.manual_seed(0)
        grads.extend(torch.autograd.grad(flash_attn_ext.flash_attn_func(q, k, v, **kwargs), (q, k, v), dout))

    rows = _sm90_rows(call, "flash_bwd_dkv")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    expected = _dkv_row(96, seqlen, seqlen, batch * 8, num_sms, softcap_or_dropout=twin in ("softcap", "dropout"))
    assert rows == ({expected} if _sm90_backward_runs(bwd_path) else set()), rows
    assert all(torch.isfinite(g).all() for g in grads)
    env = dict(os.environ, FLASH_ATTN_EXT_SM90_BWD_LONG_ROWS="0")
    r = subprocess.run([sys.executable, "-c", _KNOB_OFF_TWIN_SCRIPT, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    for name, a, b in zip(("dq", "dk", "dv"), grads, torch.load(tmp_path / "out.pt")):
        assert torch.equal(a, b), f"{name}: the {expected} row and DkvTile disagree ({twin})"


# ---- The short-sequence dQ rows (sm90/tile_config.h: DqShortTile, chosen by dq_short_rows): at d96
# and d128, calls whose sequences hold at most 512 queries and 512 keys on average when causal (256
# when not) run the sm90 dQ kernel on 64 x 64 tiles, two CTAs per SM, instead of DqTile's 128 x 128.
# Each dQ row's k16 steps over the keys keep their order, so both rows give the same bits; a varlen
# call decides by total_q / batch and total_k / batch, so a packed batch can take the other row
# than its sequences alone.

# (batch, seqlen_q, seqlen_k, causal): the short row up to the bound (dense seqlen_q and seqlen_k),
# the wide one past it (queries past it, or keys: 512 x 700 causal, 100 x 2048).
DQ_SHORT_CASES = [(3, 256, 256, False), (3, 257, 300, False), (2, 512, 512, True), (2, 512, 700, True),
                  (2, 513, 513, True), (4, 136, 136, True), (4, 136, 136, False), (1, 100, 2048, False)]


@pytest.mark.parametrize("case", DQ_SHORT_CASES, ids=lambda c: "b{}_{}x{}_{}".format(*c[:3], "causal" if c[3] else "full"))
@pytest.mark.parametrize("headdim", [96, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_backward_short_dq_rows(dtype, headdim, case, bwd_path, poison_empty):
    """GQA 2:1: the dispatch takes the short dQ row exactly where dq_short_rows says (dense:
    seqlen_q and seqlen_k), its gradients are within the rule, and they are the bits of the same
    sequences in a varlen call that takes the other dQ row (a 2048-row sequence packed with them
    moves the means past the bound; a batch past it packed with 136-row sequences brings them under)."""
    require_hdim(headdim, exact=True)
    if bwd_path == "sm80":
        pytest.skip("the short dQ row is a row of the sm90 dQ kernel")
    batch, seqlen_q, seqlen_k, causal = case
    nheads, nheads_k, scale = 4, 2, 1.0 / math.sqrt(headdim)
    dense_call = lambda b, sq, sk: _dense_backward_rows(b, sq, sk, nheads, nheads_k, headdim, dtype, scale, causal,
                                                        "flash_bwd_dq")

    knob = os.environ.get("FLASH_ATTN_EXT_SM90_BWD_DQ_SHORT") != "0"
    short = lambda mean_q, mean_k: knob and max(mean_q, mean_k) <= (512 if causal else 256)
    sm90 = _sm90_backward_runs(bwd_path)
    expect = lambda mean_q, mean_k: ({"DqShortTile" if short(mean_q, mean_k) else "DqTile"} if sm90 else set())
    group, grads, rows = dense_call(batch, seqlen_q, seqlen_k)
    assert rows == expect(seqlen_q, seqlen_k), rows
    _check_grads(*group[:4], causal, grads)

    # Packed with a filler group that moves the means across the bound, so the varlen call takes
    # the other dQ row than the dense call did.
    filler = (1, 2048, 2048) if short(seqlen_q, seqlen_k) else (16, 136, 136)
    other, _, _ = dense_call(*filler)
    seqs = batch + filler[0]
    n_q, n_k = batch * seqlen_q + filler[0] * filler[1], batch * seqlen_k + filler[0] * filler[2]
    varlen = []
    varlen_rows = _sm90_rows(lambda: varlen.extend(_varlen_backward_of_dense([group, other], scale, causal)),
                             "flash_bwd_dq")
    assert varlen_rows == expect(n_q // seqs, n_k // seqs), varlen_rows
    if knob and sm90:
        assert varlen_rows != rows
    rows_q, rows_k = batch * seqlen_q, batch * seqlen_k
    for name, a, b, n in zip(("dq", "dk", "dv"), grads, varlen, (rows_q, rows_k, rows_k)):
        assert torch.equal(_packed(a), b[:n]), f"{name}: the short and the wide dQ rows disagree"
