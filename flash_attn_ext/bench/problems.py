"""The cases' inputs and the work they count: one class per problem shape, each with ``sets`` of
(q, k, v, dout) rotated between timed calls, ``inputs``, ``bind`` (an implementation's call with
the case's other arguments bound), ``rates`` (its metric over a median time) and ``err_slice``
/ ``err_index`` (the rows and heads of the first input set that the errors are checked on,
bench.accuracy):

    Problem         dense BSHD (batch, seqlen, nheads, headdim); modes fwd, bwd, fwd_bwd.
                    TFLOP/s by the standard count (flash_attn_ext.reference.attention_flops):
                    forward 4*B*H*N^2*d, halved when causal; bwd 2.5x, fwd_bwd 3.5x.
    DecodeProblem   one decode step (seqlen_q = 1) against a KV cache, contiguous or paged, full
                    (every sequence uses all Nk keys) or ragged (--decode-fill F < 1: each
                    sequence uses the first cache_seqlens[b] keys, decode_lengths); mode decode.
                    TB/s = K+V bytes read, 2*(sum of the used lengths)*nheads_k*d*elem (full:
                    2*B*Nk*nheads_k*d*elem, decode_kv_bytes; q, out and the block table are not
                    counted). The page sizes of one (batch, Nk) are made together (make_group),
                    sharing one K/V allocation, so that they are timed in one interleaved group.
    VarlenProblem   packed sequences (total, nheads, d) with cu_seqlens; modes varlen_fwd and
                    varlen_bwd (the backward alone). TFLOP/s on the real work: the dense count of
                    each sequence alone, summed (varlen_flops), so no padding is counted.

Input sets: when one set is smaller than 4x the L2 cache, several are rotated (input_sets_needed,
sets_for_bytes) so that a short problem is not read from L2.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable

import torch

from flash_attn_ext.bench.peers import Impl
from flash_attn_ext.reference import attention_flops

MAX_INPUT_SETS = 8
BASE_MODE = {"decode": "fwd", "varlen_fwd": "fwd", "varlen_bwd": "bwd"}


def base_mode(mode: str) -> str:
    """fwd, bwd or fwd_bwd: what ``mode`` times (decode and varlen_fwd a forward, varlen_bwd the
    backward alone)."""
    return BASE_MODE.get(mode, mode)


def decode_kv_bytes(batch: int, seqlen_k: int, nheads_k: int, headdim: int, elem_size: int) -> int:
    """Bytes of K and V one decode step reads: 2 * batch * seqlen_k * nheads_k * headdim * elem
    (a full cache; a ragged one reads those of its used lengths' sum, DecodeProblem.kv_bytes)."""
    return 2 * batch * seqlen_k * nheads_k * headdim * elem_size


def decode_lengths(batch: int, seqlen_k: int, fill: float = 1.0, seed: int = 0) -> list[int]:
    """The used cache length of each of ``batch`` sequences (cache_seqlens) for a cache of
    ``seqlen_k`` keys filled to ``fill`` (--decode-fill F, 0 < F <= 1) on average: the lengths are
    spread evenly over [F*Nk - w, F*Nk + w], w = min(F, 1 - F) * Nk (the widest interval of mean
    F*Nk inside the cache), one at the midpoint of each of ``batch`` equal strata, rounded, at
    least 1, in an order shuffled by ``seed``. F = 1: every sequence uses the whole cache (Nk);
    batch 1: round(F*Nk); F = 0.5: spread over 1..Nk. The mean is F*Nk up to the rounding, whatever
    the seed, so TB/s of one fill compare across seeds and batch sizes."""
    if not 0.0 < fill <= 1.0:
        raise ValueError(f"fill: expected a fraction in (0, 1], got {fill}")
    mean, half = fill * seqlen_k, min(fill, 1.0 - fill) * seqlen_k
    spread = [mean - half + (i + 0.5) * 2 * half / batch for i in range(batch)]
    lengths = [min(seqlen_k, max(1, round(x))) for x in spread]
    order = torch.randperm(batch, generator=torch.Generator().manual_seed(seed)).tolist()
    return [lengths[i] for i in order]


def varlen_flops(seqlens_q, seqlens_k, nheads: int, headdim: int, causal: bool,
                 mode: str = "fwd") -> float:
    """FLOPs of a varlen call: the standard dense count (attention_flops) of every sequence alone,
    summed (4 * Lq * Lk * d * nheads each, halved when causal; bwd 2.5x, fwd_bwd 3.5x)."""
    return sum(attention_flops(1, nheads, lq, lk, headdim, causal, base_mode(mode))
               for lq, lk in zip(seqlens_q, seqlens_k))


def mixed_lengths(n_seqs: int, total: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """``n_seqs`` sequence lengths in [lo, hi] that sum to ``total`` (seeded, in random order):
    ``lo`` each, and the other ``total - n_seqs * lo`` tokens shared by random weights (uniforms
    to the 6th power: many short sequences, a few long ones, as a mean of 256 in 128..1024
    requires), no length past ``hi``; what the rounding leaves goes one token at a time to
    random sequences under ``hi``. 64 in 128..1024 summing to 16384, seed 0: 128..1024."""
    if n_seqs <= 0 or lo <= 0 or lo > hi or not n_seqs * lo <= total <= n_seqs * hi:
        raise ValueError(f"{n_seqs} lengths in [{lo}, {hi}] cannot sum to {total}")
    g = torch.Generator().manual_seed(seed)
    weights = (torch.rand(n_seqs, generator=g, dtype=torch.float64) ** 6 + 1e-3).tolist()
    order = torch.randperm(n_seqs, generator=g).tolist()
    extra, cap, left = [0] * n_seqs, hi - lo, total - n_seqs * lo
    while left > 0:
        room = [i for i in range(n_seqs) if extra[i] < cap]
        wsum = sum(weights[i] for i in room)
        share = {i: min(cap - extra[i], int(left * weights[i] / wsum)) for i in room}
        if sum(share.values()) == 0:  # the rounding remainder
            share = {}
            for i in order:
                if len(share) == left:
                    break
                if extra[i] < cap:
                    share[i] = 1
        for i, n in share.items():
            extra[i] += n
        left -= sum(share.values())
    return [lo + e for e in extra]


@dataclasses.dataclass
class _Heads:
    """What every case kind shares: the head configuration, dtype, device and softmax scale."""

    nheads: int
    nheads_k: int
    headdim: int
    dtype: torch.dtype
    device: torch.device
    softmax_scale: float

    def err_heads(self, err_kv: int) -> tuple[list[int], list[int]]:
        """(KV heads, query heads) the errors are checked on: ``err_kv`` KV heads (at most every
        one), the first ``err_kv - 1`` and the last, so that the end of the grid (where a launch-
        size or 32-bit offset overflow shows) is checked as well as its start; with their query
        heads, whole GQA groups (query head h belongs to KV head h // (nheads / nheads_k))."""
        n = min(err_kv, self.nheads_k)
        kv = [*range(n - 1), self.nheads_k - 1]
        g = self.nheads // self.nheads_k
        return kv, [j * g + i for j in kv for i in range(g)]

    def err_index(self, err_kv: int) -> tuple:
        """(rows, KV heads, query heads) of the timed call's result that the errors are checked
        on (rows: indices into dim 0, None: every row); ``err_slice`` holds those of the inputs."""
        return (self.err_rows(), *self.err_heads(err_kv))

    def _set0_slice(self, err_kv: int, q_rows: list | None, kv_rows: list | None, kv=None) -> dict:
        """The ``nheads``, ``nheads_k`` and ``sets`` (dataclasses.replace's fields) of set 0 cut to
        the KV heads of ``err_heads`` and their query heads, and to the rows ``q_rows`` of q /
        dout and ``kv_rows`` of k / v (indices into dim 0; None: every row), as copies; ``kv``:
        (k, v) to cut instead of set 0's."""
        q, k, v, dout = self.sets[0]
        k, v = kv if kv is not None else (k, v)
        kv_heads, q_heads = self.err_heads(err_kv)

        def cut(t, rows, heads):
            if t is None:
                return None
            if rows is not None:
                t = t.index_select(0, torch.tensor(rows, device=t.device))
            return t.index_select(t.dim() - 2, torch.tensor(heads, device=t.device)).contiguous()

        sets = [(cut(q, q_rows, q_heads), cut(k, kv_rows, kv_heads), cut(v, kv_rows, kv_heads),
                 cut(dout, q_rows, q_heads))]
        return dict(nheads=len(q_heads), nheads_k=len(kv_heads), sets=sets)


def _first_and_last(n: int) -> list[int]:
    """Indices 0 and n - 1 (one index where n is 1): the batch items the errors are checked on."""
    return sorted({0, n - 1})


@dataclasses.dataclass
class Problem(_Heads):
    """One case's inputs: ``sets`` of (q, k, v, dout) BSHD tensors, rotated between calls."""

    METRIC = "tflops"

    batch: int
    seqlen: int
    causal: bool
    sets: list

    @classmethod
    def make(cls, batch, seqlen, nheads, nheads_k, headdim, causal, dtype, device, n_sets=1, seed=0):
        g = torch.Generator(device=device).manual_seed(seed)
        sets = []
        for _ in range(n_sets):
            q = torch.randn(batch, seqlen, nheads, headdim, dtype=dtype, device=device, generator=g)
            k = torch.randn(batch, seqlen, nheads_k, headdim, dtype=dtype, device=device, generator=g)
            v = torch.randn(batch, seqlen, nheads_k, headdim, dtype=dtype, device=device, generator=g)
            dout = torch.randn_like(q)
            sets.append((q, k, v, dout))
        return cls(nheads=nheads, nheads_k=nheads_k, headdim=headdim, dtype=dtype, device=device,
                   softmax_scale=1.0 / math.sqrt(headdim), batch=batch, seqlen=seqlen, causal=causal,
                   sets=sets)

    def inputs(self, grad: bool, i: int = 0) -> tuple:
        """Input set ``i`` as (q, k, v, dout); with ``grad``, q, k, v are fresh leaves that
        require grad."""
        q, k, v, dout = self.sets[i]
        if not grad:
            return q, k, v, dout
        return q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_(), dout

    def bind(self, impl: Impl) -> Callable:
        """``f(q, k, v) -> out``: the implementation with this case's scale and mask."""
        return lambda q, k, v: impl.fn(q, k, v, self.softmax_scale, self.causal)

    def rates(self, mode: str, ms: float) -> dict:
        """TFLOP/s of ``mode`` (a varlen mode: its base mode, for the ours-dense twin)."""
        flops = attention_flops(self.batch, self.nheads, self.seqlen, self.seqlen, self.headdim,
                                self.causal, base_mode(mode))
        return {"tflops": flops / (ms * 1e-3) / 1e12}

    def err_rows(self) -> list[int]:
        """The batch items the errors are checked on: the first and the last."""
        return _first_and_last(self.batch)

    def err_slice(self, err_kv: int) -> "Problem":
        """The rows of set 0 the errors are checked on (err_index), as a problem of their own:
        the first and last batch items, ``err_kv`` KV heads (err_heads) and their query heads."""
        rows = self.err_rows()
        return dataclasses.replace(self, batch=len(rows), **self._set0_slice(err_kv, rows, rows))


@dataclasses.dataclass
class DecodeProblem(_Heads):
    """One decode step: ``sets`` of (q, k_cache, v_cache, None), q (batch, 1, nheads, headdim);
    the cache contiguous (batch, seqlen_k, nheads_k, headdim) (page_size 0) or paged
    (batch * blocks, page_size, nheads_k, headdim) with ``block_table`` (batch, blocks) int32, a
    seeded random permutation of the blocks (as a serving cache scatters them). Sequence b uses
    the first ``cache_seqlens[b]`` keys (int32, (batch,)): decode_lengths of ``fill`` (1.0: the
    whole cache, seqlen_k each); the cache holds seqlen_k keys per sequence either way.
    ``cuda_graph``: time each step as the replay of a CUDA graph captured per input set
    (``--decode-graph``), as serving engines run decode steps, instead of an eager call."""

    METRIC = "tbps"
    causal = False  # seqlen_q = 1 against the whole cache: bottom-right causal masks nothing

    batch: int
    seqlen_k: int
    page_size: int
    cache_seqlens: torch.Tensor
    block_table: torch.Tensor | None
    sets: list
    cuda_graph: bool = False
    fill: float = 1.0

    @classmethod
    def make(cls, batch, seqlen_k, nheads, nheads_k, headdim, page_size, dtype, device, n_sets=1,
             seed=0, cuda_graph=False, fill=1.0) -> "DecodeProblem":
        """One page size's problem (make_group of that page size alone)."""
        return cls.make_group(batch, seqlen_k, nheads, nheads_k, headdim, [page_size], dtype, device,
                              n_sets, seed, cuda_graph, fill)[0]

    @classmethod
    def make_group(cls, batch, seqlen_k, nheads, nheads_k, headdim, page_sizes, dtype, device,
                   n_sets=1, seed=0, cuda_graph=False, fill=1.0) -> list["DecodeProblem"]:
        """One problem per page size of ``page_sizes`` (0: contiguous), all of one (batch,
        seqlen_k), made together so that they are timed in one interleaved group (bench.sweeps):
        they share q and cache_seqlens, and each input set's K and V are one allocation of the
        largest cache's rows, viewed as (batch, seqlen_k, ...) by the contiguous problem and as
        (batch * blocks, page_size, ...) by each paged one (with its own seeded block table), so
        that a group takes the memory of one problem."""
        g = torch.Generator(device=device).manual_seed(seed)
        pages = list(dict.fromkeys(page_sizes))
        blocks = {p: -(-seqlen_k // p) if p else 0 for p in pages}
        shapes = {p: (batch * blocks[p], p) if p else (batch, seqlen_k) for p in pages}
        rows = max(math.prod(shape) for shape in shapes.values())
        stored = []
        for _ in range(n_sets):
            q = torch.randn(batch, 1, nheads, headdim, dtype=dtype, device=device, generator=g)
            k = torch.randn(rows, nheads_k, headdim, dtype=dtype, device=device, generator=g)
            v = torch.randn(rows, nheads_k, headdim, dtype=dtype, device=device, generator=g)
            stored.append((q, k, v))
        tables = {p: torch.randperm(batch * blocks[p], generator=g, device=device)
                  .view(batch, blocks[p]).to(torch.int32) for p in pages if p}
        cache_seqlens = torch.tensor(decode_lengths(batch, seqlen_k, fill, seed), dtype=torch.int32,
                                     device=device)
        problems = {}
        for p in pages:
            n, shape = math.prod(shapes[p]), (*shapes[p], nheads_k, headdim)
            sets = [(q, k[:n].view(shape), v[:n].view(shape), None) for q, k, v in stored]
            problems[p] = cls(nheads=nheads, nheads_k=nheads_k, headdim=headdim, dtype=dtype,
                              device=device, softmax_scale=1.0 / math.sqrt(headdim), batch=batch,
                              seqlen_k=seqlen_k, page_size=p, cache_seqlens=cache_seqlens,
                              block_table=tables.get(p), sets=sets, cuda_graph=cuda_graph, fill=fill)
        return [problems[p] for p in page_sizes]

    @property
    def seqlen(self) -> int:
        return self.seqlen_k

    def inputs(self, grad: bool, i: int = 0) -> tuple:
        if grad:
            raise ValueError("a decode step has no backward here")
        return self.sets[i]

    def contiguous_cache(self, i: int = 0) -> tuple:
        """(k, v) of set ``i`` as (batch, seqlen_k, nheads_k, headdim): the paged cache gathered
        through the block table (for the reference; sequence b's keys past cache_seqlens[b] are
        there but unused)."""
        _, k, v, _ = self.sets[i]
        if self.block_table is None:
            return k, v
        gather = lambda t: t[self.block_table.long()].flatten(1, 2)[:, :self.seqlen_k]
        return gather(k), gather(v)

    def bind(self, impl: Impl) -> Callable:
        """``f(q, k_cache, v_cache) -> out`` with this case's cache_seqlens, block table, scale."""
        return lambda q, k, v: impl.fn(q, k, v, self.cache_seqlens, self.block_table,
                                       self.softmax_scale)

    def kv_bytes(self) -> int:
        """Bytes of K and V the step reads: each sequence's used keys (cache_seqlens), summed
        (decode_kv_bytes of one sequence that long)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        used = int(self.cache_seqlens.sum())
        return decode_kv_bytes(1, used, self.nheads_k, self.headdim, elem)

    def rates(self, mode: str, ms: float) -> dict:
        return {"tbps": self.kv_bytes() / (ms * 1e-3) / 1e12}

    def err_rows(self) -> list[int]:
        """The sequences the errors are checked on: the first and the last."""
        return _first_and_last(self.batch)

    def err_slice(self, err_kv: int) -> "DecodeProblem":
        """The rows of set 0 the errors are checked on (err_index), as a problem of their own
        (eager calls): the first and last sequences, ``err_kv`` KV heads (err_heads) and their
        query heads; a paged cache keeps those sequences' pages alone, in the same relative order
        (the block table renumbered)."""
        rows = self.err_rows()
        nb, at = len(rows), torch.tensor(rows, device=self.cache_seqlens.device)
        _, k, v, _ = self.sets[0]
        table = self.block_table
        if table is not None:
            pages, order = table[at].flatten().long().sort()
            table = torch.empty_like(pages)
            table[order] = torch.arange(len(pages), device=pages.device)
            k, v, table = k[pages], v[pages], table.view(nb, -1).to(torch.int32)
        part = self._set0_slice(err_kv, rows, None if table is not None else rows, kv=(k, v))
        return dataclasses.replace(self, batch=nb, cache_seqlens=self.cache_seqlens[at],
                                   block_table=table, cuda_graph=False, **part)


@dataclasses.dataclass
class VarlenProblem(_Heads):
    """Packed sequences: ``sets`` of (q, k, v, dout), q/dout (total, nheads, headdim), k/v
    (total, nheads_k, headdim); sequence b holds rows cu_seqlens[b]:cu_seqlens[b+1] of q and of
    k/v (self-attention: the same lengths for q and k)."""

    METRIC = "tflops"

    seqlens: list
    causal: bool
    cu_seqlens: torch.Tensor
    sets: list

    @classmethod
    def make(cls, seqlens, nheads, nheads_k, headdim, causal, dtype, device, n_sets=1, seed=0):
        g = torch.Generator(device=device).manual_seed(seed)
        total = sum(seqlens)
        sets = []
        for _ in range(n_sets):
            q = torch.randn(total, nheads, headdim, dtype=dtype, device=device, generator=g)
            k = torch.randn(total, nheads_k, headdim, dtype=dtype, device=device, generator=g)
            v = torch.randn(total, nheads_k, headdim, dtype=dtype, device=device, generator=g)
            sets.append((q, k, v, torch.randn_like(q)))
        cu = torch.tensor([0, *itertools.accumulate(seqlens)], dtype=torch.int32, device=device)
        return cls(nheads=nheads, nheads_k=nheads_k, headdim=headdim, dtype=dtype, device=device,
                   softmax_scale=1.0 / math.sqrt(headdim), seqlens=list(seqlens), causal=causal,
                   cu_seqlens=cu, sets=sets)

    @property
    def seqlen(self) -> int:
        """The longest sequence (max_seqlen_q = max_seqlen_k)."""
        return max(self.seqlens)

    inputs = Problem.inputs

    def bind(self, impl: Impl) -> Callable:
        n = self.seqlen
        return lambda q, k, v: impl.fn(q, k, v, self.cu_seqlens, self.cu_seqlens, n, n,
                                       self.softmax_scale, self.causal)

    def rates(self, mode: str, ms: float) -> dict:
        flops = varlen_flops(self.seqlens, self.seqlens, self.nheads, self.headdim, self.causal, mode)
        return {"tflops": flops / (ms * 1e-3) / 1e12}

    def err_rows(self) -> None:
        """Every token (every sequence) is checked."""
        return None

    def err_slice(self, err_kv: int) -> "VarlenProblem":
        """The rows of set 0 the errors are checked on (err_index), as a problem of their own:
        every sequence, ``err_kv`` KV heads (err_heads) and their query heads."""
        return dataclasses.replace(self, **self._set0_slice(err_kv, None, None))


def script_args(ap, seqlen: str, rep_ms: float, rounds: int | None = 3) -> None:
    """The flags every diagnostic script of a feature's cost shares (scripts/sinks_bench.py,
    window_bench.py, softcap_bench.py): --device, --hdim, --seqlen, --tokens, --rep-ms and, unless
    ``rounds`` is None, --rounds (alternated rounds)."""
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hdim", default="64,128")
    ap.add_argument("--seqlen", default=seqlen)
    ap.add_argument("--tokens", type=int, default=16384, help="batch = tokens / seqlen (at least 1)")
    if rounds is not None:
        ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--rep-ms", type=float, default=rep_ms,
                    help="timed repetitions per measurement (the benchmark's Timer)")


def dense_cases(args, device: torch.device, dtype: torch.dtype):
    """Those scripts' dense cases: for each --hdim d and --seqlen n, nheads = 2048 / d and batch =
    --tokens / n (at least 1), random q, k, v (requiring grad) and dout; yields (d, n, batch,
    nheads, q, k, v, dout)."""
    for d in (int(x) for x in args.hdim.split(",")):
        nheads = max(1, 2048 // d)
        for n in (int(x) for x in args.seqlen.split(",")):
            batch = max(1, args.tokens // n)
            q, k, v = (torch.randn(batch, n, nheads, d, device=device, dtype=dtype, requires_grad=True)
                       for _ in range(3))
            yield d, n, batch, nheads, q, k, v, torch.randn_like(q)


def input_sets_needed(batch, seqlen, nheads, nheads_k, headdim, dtype, l2_bytes) -> int:
    """Input sets to rotate so that the sets together exceed 4x L2 (q, k, v, out, dout)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sets_for_bytes(batch * seqlen * (3 * nheads + 2 * nheads_k) * headdim * elem, l2_bytes)


def sets_for_bytes(nbytes: int, l2_bytes: int) -> int:
    """Input sets of ``nbytes`` each to rotate so that together they exceed 4x L2 (at most
    MAX_INPUT_SETS)."""
    if nbytes >= 4 * l2_bytes:
        return 1
    return min(MAX_INPUT_SETS, math.ceil(4 * l2_bytes / max(nbytes, 1)))


# Bytes the rotated K/V caches of one decode group may take together (every set allocates the
# whole cache, whatever --decode-fill reads of it).
MAX_DECODE_CACHE_BYTES = 16 * 2**30


def decode_input_sets(used_bytes: int, cache_bytes: int, l2_bytes: int) -> int:
    """Input sets of a decode group: sets_for_bytes of the K/V bytes a call reads (``used_bytes``),
    but no more than fit MAX_DECODE_CACHE_BYTES of whole caches (``cache_bytes`` each; at least
    one): a ragged cache reads little of a large allocation, and the L2 is flushed before every
    timed call anyway."""
    return max(1, min(sets_for_bytes(used_bytes, l2_bytes), MAX_DECODE_CACHE_BYTES // max(cache_bytes, 1)))
