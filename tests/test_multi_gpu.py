"""Calls on a GPU other than the current one. A model split over GPUs in one process (transformers'
``device_map="auto"``, pipeline stages, a draft model on a second GPU) keeps cuda:0 current while
layers run on cuda:1: every entry must run on its inputs' device, leave the current device as it
was, and keep its per-device state apart (the opt-in to large shared memory per kernel and
device, the backward's side stream per (thread, device, stream), the varlen forward's tile
counters per (device, stream): csrc/kernels/launch_utils.h, bwd_fork.h, flash_api.cpp).

Criterion: bit-for-bit the same call on cuda:0 (the kernels are deterministic and pick their
grids from the GPU's SM count, so two GPUs of one model give the same bits), and the current
device still cuda:0 after it. Needs two GPUs of one model; skips otherwise (CI has none)."""

import copy
import threading

import pytest
import torch

import flash_attn_ext
from conftest import require_hdim
from flash_attn_ext.nn import MultiheadFlashAttention

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="multi-GPU tests need two CUDA GPUs (fewer visible)",
)

DTYPE = torch.bfloat16


@pytest.fixture(autouse=True)
def _two_of_one_model():
    names = {torch.cuda.get_device_name(i) for i in range(2)}
    if len(names) != 1:
        pytest.skip(f"the bitwise comparison needs two GPUs of one model, got {sorted(names)}")
    with torch.cuda.device(0):
        yield
        torch.cuda.synchronize(0), torch.cuda.synchronize(1)


def _on(device, *tensors, grad=True):
    """Copies of CPU tensors on `device` (float ones as leaves requiring grad when `grad`)."""
    out = []
    for t in tensors:
        t = t.to(device)
        out.append(t.requires_grad_() if grad and t.is_floating_point() else t)
    return out


def _run(device, fn, tensors, grad=True, current=0):
    """fn(*copies of tensors on device) -> its outputs and the copies' gradients (through a random
    dout of a fixed seed), all on the CPU; checks the current device is still `current` after it."""
    args = _on(device, *tensors, grad=grad)
    outs = fn(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    assert torch.cuda.current_device() == current, f"a call on {device} changed the current device"
    result = [o.detach().cpu() for o in outs]
    if grad:
        gen = torch.Generator().manual_seed(1)
        dout = torch.randn(outs[0].shape, generator=gen, dtype=outs[0].dtype).to(device)
        leaves = [a for a in args if a.is_floating_point()]
        result += [g.cpu() for g in torch.autograd.grad(outs[0], leaves, dout)]
        assert torch.cuda.current_device() == current, f"a backward on {device} changed the current device"
    torch.cuda.synchronize(device)
    return result


def _assert_same(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape, i
        assert torch.equal(x.view(torch.int16) if x.dtype == DTYPE else x,
                           y.view(torch.int16) if y.dtype == DTYPE else y), f"output {i} differs between GPUs"


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_on_the_second_gpu(d, causal):
    require_hdim(d)
    q, k, v = (torch.randn(2, 300, h, d, dtype=DTYPE) for h in (8, 2, 2))  # GQA 4:1, a ragged last tile

    def fn(q, k, v):
        return flash_attn_ext.flash_attn_func(q, k, v, causal=causal, return_lse=True)

    _assert_same(_run("cuda:1", fn, (q, k, v)), _run("cuda:0", fn, (q, k, v)))


def test_varlen_on_the_second_gpu():
    require_hdim(128)
    lens = [17, 300, 0, 129, 64]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    total = int(cu[-1])
    q, k, v = (torch.randn(total, h, 128, dtype=DTYPE) for h in (4, 2, 2))

    def fn(q, k, v, cu):
        return flash_attn_ext.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                                     return_lse=True)

    # Twice on cuda:1 after cuda:0: the tile counters of the two devices' default streams stay apart.
    ref = _run("cuda:0", fn, (q, k, v, cu))
    for _ in range(2):
        _assert_same(_run("cuda:1", fn, (q, k, v, cu)), ref)


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_on_the_second_gpu(paged):
    require_hdim(128)
    batch, capacity, nheads_k, d = 2, 2048, 2, 128
    k_cache, v_cache = (torch.randn(batch, capacity, nheads_k, d, dtype=DTYPE) for _ in range(2))
    q = torch.randn(batch, 1, 4 * nheads_k, d, dtype=DTYPE)
    k_new, v_new = (torch.randn(batch, 1, nheads_k, d, dtype=DTYPE) for _ in range(2))
    seqlens = torch.tensor([1500, 7], dtype=torch.int32)
    table = None
    if paged:  # pages of 64 rows in a shuffled order
        page = 64
        table = torch.randperm(batch * capacity // page).view(batch, -1).to(torch.int32)
        order = table.flatten().long().argsort()  # paged[table[b, j]] = page j of sequence b
        k_cache, v_cache = (c.reshape(batch * capacity // page, page, nheads_k, d)[order] for c in (k_cache, v_cache))

    def fn(q, k_cache, v_cache, k_new, v_new, seqlens, *table):
        out, lse = flash_attn_ext.flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, block_table=table[0] if table else None,
            num_splits=4, return_lse=True)
        return out, lse, k_cache, v_cache  # the append wrote the caches in place

    args = (q, k_cache, v_cache, k_new, v_new, seqlens) + ((table,) if paged else ())
    _assert_same(_run("cuda:1", fn, args, grad=False), _run("cuda:0", fn, args, grad=False))


def test_module_on_the_second_gpu():
    require_hdim(64)
    torch.manual_seed(0)
    mha = MultiheadFlashAttention(256, 4, num_kv_heads=2, causal=True, rotary=True, dtype=DTYPE)
    x = torch.randn(2, 200, 256, dtype=DTYPE)

    def run(device):
        m = mha.to(device)
        m.zero_grad(set_to_none=True)
        xd = x.to(device).requires_grad_()
        y = m(xd)
        y.float().square().sum().backward()
        assert torch.cuda.current_device() == 0
        return [y.detach().cpu(), xd.grad.cpu()] + [p.grad.cpu() for p in m.parameters()]

    _assert_same(run("cuda:1"), run("cuda:0"))


def test_interleaved_devices_and_threads():
    """The backward's side streams are per (thread, device, stream): backwards alternating between
    the GPUs in one thread, then one thread per GPU at once, give the serial bits."""
    require_hdim(64)
    q, k, v = (torch.randn(2, 1024, 4, 64, dtype=DTYPE) for _ in range(3))

    def fn(q, k, v):
        return flash_attn_ext.flash_attn_func(q, k, v, causal=True)

    ref = _run("cuda:0", fn, (q, k, v))
    for device in ("cuda:1", "cuda:0", "cuda:1"):
        _assert_same(_run(device, fn, (q, k, v)), ref)

    results, errors = {}, []

    def worker(i):
        try:
            with torch.cuda.device(i):  # each thread's own current device, as a data-parallel worker's
                results[i] = [_run(f"cuda:{i}", fn, (q, k, v), current=i) for _ in range(3)]
        except Exception as e:  # noqa: BLE001 - reported below with the thread's device
            errors.append((i, e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(2):
        for r in results[i]:
            _assert_same(r, ref)


def test_cuda_graph_on_the_second_gpu():
    """A decode step captured on cuda:1 (its stream, its memory pool) replays with the eager bits."""
    require_hdim(128)
    dev = torch.device("cuda:1")
    with torch.cuda.device(dev):
        kc, vc = (torch.randn(2, 1024, 2, 128, device=dev, dtype=DTYPE) for _ in range(2))
        q = torch.randn(2, 1, 8, 128, device=dev, dtype=DTYPE)
        seqlens = torch.tensor([900, 33], dtype=torch.int32, device=dev)

        def step():
            return flash_attn_ext.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, return_lse=True)

        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_g, lse_g = step()
        for _ in range(2):
            q.normal_()
            graph.replay()
            out_e, lse_e = step()
            torch.cuda.synchronize(dev)
            assert torch.equal(out_g, out_e) and torch.equal(lse_g, lse_e)


def test_hugging_face_model_split_over_two_gpus():
    """transformers' device_map case: a causal LM whose first layers sit on cuda:0 and last on
    cuda:1 (accelerate's dispatch moves the hidden states and the padding mask between them), with
    left padding (the masked path's varlen calls on each GPU), gives the logits of the whole model
    on cuda:0."""
    accelerate = pytest.importorskip("accelerate")
    tf = pytest.importorskip("transformers")
    require_hdim(64)
    name = flash_attn_ext.integrations.register_transformers()
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).to(DTYPE).eval()
    model.set_attn_implementation(name)
    ids = torch.randint(0, cfg.vocab_size, (2, 100))
    mask = torch.ones(2, 100, dtype=torch.long)
    mask[1, :30] = 0  # left padding
    with torch.no_grad():
        whole = copy.deepcopy(model).to("cuda:0")
        ref = whole(input_ids=ids.to("cuda:0"), attention_mask=mask.to("cuda:0")).logits.cpu()
        del whole
        device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
                      "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}
        split = accelerate.dispatch_model(model, device_map=device_map)
        assert split.model.layers[3].self_attn.q_proj.weight.device == torch.device("cuda:1")
        out = split(input_ids=ids.to("cuda:0"), attention_mask=mask.to("cuda:0")).logits.cpu()
    assert torch.cuda.current_device() == 0
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1, 30:], ref[1, 30:])
