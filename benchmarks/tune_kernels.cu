// Tile-config tuning harness for the CUDA kernels: times several tile shapes of the forward,
// dK/dV and dQ kernels (sm80 path; all three of the sm90 path too) in one binary, without torch, on bf16 random inputs (BSHD, 16k tokens,
// 2048/hdim heads, like ../shared/ANCHORS.md), and checks every variant against the production
// config (max |difference| of its outputs). Driven by benchmarks/tune_kernels.py, which compiles one
// translation unit per variant (-DTUNE_VARIANT) in parallel and links them with this file's main.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "kernels/common/bwd_preprocess.cuh"
#include "kernels/cuda_check.h"
#include "kernels/sm80/flash_bwd_dkv_kernel.cuh"
#include "kernels/sm80/flash_bwd_dq_kernel.cuh"
#include "kernels/sm80/flash_fwd_launch.cuh"
#ifdef TUNE_SM90
#include "kernels/sm90/flash_bwd_dkv_kernel.cuh"
#include "kernels/sm90/flash_bwd_dq_kernel.cuh"
#include "kernels/sm90/flash_fwd_launch.cuh"
#endif

struct TuneVariant {
  int kind;  // 0 fwd, 1 dkv, 2 dq
  int hdim;
  std::string name;
  std::function<void(flash::Flash_bwd_params&, cudaStream_t)> run;
};
std::vector<TuneVariant>& tune_registry();
struct TuneRegistrar {
  explicit TuneRegistrar(TuneVariant v) { tune_registry().push_back(std::move(v)); }
};

#define TUNE_STR2(x) #x
#define TUNE_STR(x) TUNE_STR2(x)

#ifdef TUNE_VARIANT
// One variant per translation unit: KIND, HD, A1..A5 come from -D flags.
using Bf16 = __nv_bfloat16;
// A backward kernel (kind dkv or dq, traits Kind) of arch namespace ns with tile row Tile, launched
// as the library launches it (kernels/launch_utils.h: launch_tiles).
#define TUNE_LAUNCH_BWD(ns, Kind, kind, Tile)                                                       \
  using Traits = flash::ns::Kind##KernelTraits<Bf16, HD, Tile>;                                       \
  flash::launch_tiles<Traits, flash::Kind##Work<Traits::kBlockM, Traits::kBlockN>>(                  \
      flash::ns::flash_bwd_##kind##_kernel<Bf16, HD, Tile>, #kind, p, s)
#if KIND == 0 && defined(TUNE_SM90)
// The Hopper forward: BLOCK_M (64 query rows per consumer warpgroup) x BLOCK_N; 4 producer warps + 4
// per consumer warpgroup.
static TuneRegistrar tune_reg({0, HD, "fwd90 BM=" TUNE_STR(A1) " BN=" TUNE_STR(A2),
                               [](flash::Flash_bwd_params& p, cudaStream_t s) {
                                 using Traits = flash::sm90::FwdKernelTraits<Bf16, HD, flash::FwdTileShape<A1, A2, 4 + A1 / 16, false, 1>>;
                                 if (!flash::sm90::launch_fwd<Traits>(p, s)) {
                                   fprintf(stderr, "fwd90: the sm90 forward refused the call\n");
                                   exit(1);
                                 }
                               }});
#elif KIND == 0
static TuneRegistrar tune_reg({0, HD, "fwd BM=" TUNE_STR(A1) " BN=" TUNE_STR(A2) " warps=" TUNE_STR(A3) " qregs=" TUNE_STR(A4) " minB=" TUNE_STR(A5),
                               [](flash::Flash_bwd_params& p, cudaStream_t s) {
                                 flash::sm80::launch_fwd<flash::sm80::FwdKernelTraits<Bf16, HD, flash::FwdTileShape<A1, A2, A3, A4, A5>>>(p, s);
                               }});
#elif KIND == 1 && defined(TUNE_SM90)
#ifndef A3
#define A3 1
#endif
static TuneRegistrar tune_reg({1, HD, "dkv90 BM=" TUNE_STR(A1) " BN=" TUNE_STR(A2) " split=" TUNE_STR(A3),
                               [](flash::Flash_bwd_params& p, cudaStream_t s) {
                                 using Tile = flash::DkvTileShape<A2, A1, A3>;
                                 TUNE_LAUNCH_BWD(sm90, Dkv, dkv, Tile);
                               }});
#elif KIND == 2 && defined(TUNE_SM90)
static TuneRegistrar tune_reg({2, HD, "dq90 BM=" TUNE_STR(A1) " BN=" TUNE_STR(A2),
                               [](flash::Flash_bwd_params& p, cudaStream_t s) {
                                 using Tile = flash::DqTileShape<A1, A2>;
                                 TUNE_LAUNCH_BWD(sm90, Dq, dq, Tile);
                               }});
#elif KIND == 1
#ifndef A4
#define A4 16
#endif
#ifndef A5
#define A5 1
#endif
static TuneRegistrar tune_reg({1, HD, "dkv BM=" TUNE_STR(A1) " BN=" TUNE_STR(A2) " split=" TUNE_STR(A3) " warp_rows=" TUNE_STR(A4) " fast_copy=" TUNE_STR(A5),
                               [](flash::Flash_bwd_params& p, cudaStream_t s) {
                                 using Tile = flash::DkvTileShape<A2, A1, A3, A4, bool(A5)>;
                                 TUNE_LAUNCH_BWD(sm80, Dkv, dkv, Tile);
                               }});
#else
#ifndef A3
#define A3 16
#endif
#ifndef A4
#define A4 1
#endif
static TuneRegistrar tune_reg({2, HD, "dq BM=" TUNE_STR(A1) " BN=" TUNE_STR(A2) " warp_rows=" TUNE_STR(A3) " fast_copy=" TUNE_STR(A4),
                               [](flash::Flash_bwd_params& p, cudaStream_t s) {
                                 using Tile = flash::DqTileShape<A1, A2, A3, bool(A4)>;
                                 TUNE_LAUNCH_BWD(sm80, Dq, dq, Tile);
                               }});
#endif

#else  // the main translation unit

std::vector<TuneVariant>& tune_registry() {
  static std::vector<TuneVariant> r;
  return r;
}

__global__ void fill_random(__nv_bfloat16* x, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = unsigned(i) * 2654435761u ^ seed;
    h ^= h >> 16; h *= 0x7feb352du; h ^= h >> 15; h *= 0x846ca68bu; h ^= h >> 16;
    unsigned h2 = h * 747796405u + 2891336453u;
    float u1 = (h & 0xffffff) / 16777216.f + 1e-7f, u2 = (h2 & 0xffffff) / 16777216.f;
    x[i] = __float2bfloat16(sqrtf(-2.f * logf(u1)) * cosf(6.2831853f * u2));  // N(0, 1)
  }
}

__global__ void max_abs_diff(const __nv_bfloat16* a, const __nv_bfloat16* b, size_t n, float* out) {
  float m = 0.f;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    m = fmaxf(m, fabsf(__bfloat162float(a[i]) - __bfloat162float(b[i])));
  atomicMax(reinterpret_cast<int*>(out), __float_as_int(m));  // m >= 0: int order = float order
}

static float diff(const __nv_bfloat16* a, const __nv_bfloat16* b, size_t n, float* d_scratch) {
  FLASH_CHECK_CUDA(cudaMemset(d_scratch, 0, sizeof(float)));
  max_abs_diff<<<1024, 256>>>(a, b, n, d_scratch);
  FLASH_CHECK_LAUNCH();
  float h = 0.f;
  FLASH_CHECK_CUDA(cudaMemcpy(&h, d_scratch, sizeof(float), cudaMemcpyDeviceToHost));
  return h;
}

static float time_ms(const std::function<void()>& fn) {
  cudaEvent_t a, b;
  FLASH_CHECK_CUDA(cudaEventCreate(&a));
  FLASH_CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) fn();
  std::vector<float> t;
  for (int i = 0; i < 15; ++i) {
    FLASH_CHECK_CUDA(cudaEventRecord(a));
    fn();
    FLASH_CHECK_CUDA(cudaEventRecord(b));
    FLASH_CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0.f;
    FLASH_CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main(int argc, char** argv) {
  // Usage: tune_kernels [seqlen ...]   (default 1024 4096 16384); hdims and causal from the registry.
  std::vector<int> seqlens;
  for (int i = 1; i < argc; ++i) seqlens.push_back(atoi(argv[i]));
  if (seqlens.empty()) seqlens = {1024, 4096, 16384};
  cudaDeviceProp prop;
  FLASH_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  // fwd before dkv before dq; within a kind, link order (the driver's order: reference first).
  std::stable_sort(tune_registry().begin(), tune_registry().end(),
                   [](const TuneVariant& a, const TuneVariant& b) { return a.kind < b.kind; });
  std::vector<int> hdims;
  for (auto& v : tune_registry())
    if (std::find(hdims.begin(), hdims.end(), v.hdim) == hdims.end()) hdims.push_back(v.hdim);
  std::sort(hdims.begin(), hdims.end());
  float* d_scratch;
  FLASH_CHECK_CUDA(cudaMalloc(&d_scratch, sizeof(float)));
  printf("%-4s %-6s %-6s %-5s %-62s %9s %9s %10s\n", "hdim", "causal", "N", "kind", "variant", "ms", "TFLOP/s", "maxdiff");
  for (int d : hdims) {
    // Per kind, the first registered variant of (kind, hdim) is the reference config.
    for (int causal = 0; causal < 2; ++causal) {
      for (int n : seqlens) {
        const int b = std::max(1, 16384 / n), h = 2048 / d;
        const size_t numel = size_t(b) * n * h * d;
        const int n_round = (n + 127) / 128 * 128;
        std::vector<__nv_bfloat16*> bufs;
        auto alloc = [&](size_t elems) {
          __nv_bfloat16* p;
          FLASH_CHECK_CUDA(cudaMalloc(&p, elems * sizeof(__nv_bfloat16)));
          bufs.push_back(p);
          return p;
        };
        __nv_bfloat16 *q = alloc(numel), *k = alloc(numel), *v = alloc(numel), *o = alloc(numel),
                      *dout = alloc(numel), *dq = alloc(numel), *dk = alloc(numel), *dv = alloc(numel),
                      *ref0 = alloc(numel), *ref1 = alloc(numel), *ref2 = alloc(numel);
        float *lse, *stats, *ws;  // softmax_lse, (row max, log2 sum), (D, hi, lo)
        int* precise;
        FLASH_CHECK_CUDA(cudaMalloc(&lse, size_t(b) * h * n * 4));
        FLASH_CHECK_CUDA(cudaMalloc(&stats, 2 * size_t(b) * h * n * 4));
        FLASH_CHECK_CUDA(cudaMalloc(&ws, 3 * size_t(b) * h * n_round * 4));
        FLASH_CHECK_CUDA(cudaMalloc(&precise, size_t(b) * h * (n_round / 128) * 4));
        fill_random<<<1024, 256>>>(q, numel, 1);
        fill_random<<<1024, 256>>>(k, numel, 2);
        fill_random<<<1024, 256>>>(v, numel, 3);
        fill_random<<<1024, 256>>>(dout, numel, 4);
        FLASH_CHECK_LAUNCH();
        flash::Flash_bwd_params p;
        const int64_t row = int64_t(h) * d, batch = int64_t(n) * row;
        auto bshd = [&](__nv_bfloat16* ptr) {
          flash::TensorView t;
          t.ptr = ptr, t.batch_stride = batch, t.row_stride = row, t.head_stride = d;
          return t;
        };
        p.q = bshd(q), p.k = bshd(k), p.v = bshd(v), p.o = bshd(o), p.dout = bshd(dout);
        p.dq = bshd(dq), p.dk = bshd(dk), p.dv = bshd(dv);
        p.h = p.h_k = h; p.h_h_k_ratio = 1;
        p.softmax_lse_ptr = lse;
        p.row_max_ptr = stats, p.row_log2sum_ptr = stats + size_t(b) * h * n;
        p.dsoftmax_sum_ptr = ws, p.softmax_lse_log2_ptr = ws + size_t(b) * h * n_round;
        p.softmax_lse_log2_lo_ptr = ws + 2 * size_t(b) * h * n_round;
        p.precise_rows_ptr = precise;
        p.b = b; p.seqlen_q = p.seqlen_k = n; p.seqlen_q_rounded = n_round; p.d = p.d_rounded = d;
        p.scale_softmax = 1.0 / sqrt(double(d));
        p.scale_softmax_log2 = float(p.scale_softmax * 1.4426950408889634);
        p.is_causal = causal; p.is_bf16 = true;
        p.arch = prop.major * 10 + prop.minor; p.num_sms = prop.multiProcessorCount;
        const double fwd_flops = 4.0 * b * h * double(n) * n * d * (causal ? 0.5 : 1.0);
        bool first[3] = {true, true, true};
        bool bwd_ready = false;
        const TuneVariant* fwd_ref = nullptr;
        for (auto& var : tune_registry()) {
          if (var.hdim != d) continue;
          if (var.kind == 0 && !fwd_ref) fwd_ref = &var;
          if (var.kind != 0 && !bwd_ready) {
            // Backward inputs: o and lse from the reference forward config, then the preprocess.
            if (!fwd_ref) { fprintf(stderr, "hdim %d: register a fwd variant first\n", d); return 1; }
            fwd_ref->run(p, nullptr);
            flash::run_bwd_preprocess<__nv_bfloat16>(p, nullptr);
            FLASH_CHECK_CUDA(cudaDeviceSynchronize());
            bwd_ready = true;
          }
          // The first variant of each kind is the reference; the others are checked against it.
          __nv_bfloat16* out = var.kind == 0 ? o : var.kind == 1 ? dk : dq;
          __nv_bfloat16* ref = var.kind == 0 ? ref0 : var.kind == 1 ? ref1 : ref2;
          FLASH_CHECK_CUDA(cudaMemset(out, 0xff, numel * 2));  // poison (NaN)
          var.run(p, nullptr);
          FLASH_CHECK_CUDA(cudaDeviceSynchronize());
          float md = 0.f;
          if (first[var.kind]) {
            FLASH_CHECK_CUDA(cudaMemcpy(ref, out, numel * 2, cudaMemcpyDeviceToDevice));
            first[var.kind] = false;
          } else {
            md = diff(out, ref, numel, d_scratch);  // NaN (unwritten) shows as a huge value
          }
          const float ms = time_ms([&] { var.run(p, nullptr); });
          // Share of the 2.5x-forward backward FLOPs: dkv does 4 of 7 matmuls, dq 3 of 7
          // (so TFLOP/s of dkv and dq are comparable with each other and with fwd).
          const double flops = var.kind == 0 ? fwd_flops : fwd_flops * (var.kind == 1 ? 2.0 : 1.5);
          printf("%-4d %-6s %-6d %-5s %-62s %9.3f %9.1f %10.3g\n", d, causal ? "yes" : "no", n,
                 var.kind == 0 ? "fwd" : var.kind == 1 ? "dkv" : "dq", var.name.c_str(), ms,
                 flops / ms * 1e-9, md);
          fflush(stdout);
        }
        for (auto* ptr : bufs) FLASH_CHECK_CUDA(cudaFree(ptr));
        for (void* ptr : {static_cast<void*>(lse), static_cast<void*>(stats), static_cast<void*>(ws),
                          static_cast<void*>(precise)}) {
          FLASH_CHECK_CUDA(cudaFree(ptr));
        }
      }
    }
  }
  return 0;
}
#endif
