// Tile-config tuning harness for the CUDA kernels: times several tile shapes of the forward,
// dK/dV and dQ kernels (sm80 path; all three of the sm90 path too) in one binary, without torch, on bf16 random inputs (BSHD, 16k tokens,
// 2048/hdim heads, like ../shared/ANCHORS.md), and checks every variant against the production
// config (max |difference| of its outputs). Driven by benchmarks/tune_kernels.py, which compiles one
// translation unit per variant (-DTUNE_VARIANT) in parallel and links them with this file's main.
// The split-KV forward (kind splitkv) is timed on decode steps instead (issue 14's cases: one
// query, GQA heads, a full KV cache, contiguous or paged; split kernel + combine, L2 flushed
// before each call as the benchmark does), per split count; see main's usage line.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "kernels/common/bwd_preprocess.cuh"
#include "kernels/common/combine_kernel.cuh"
#include "kernels/common/splitkv_heuristic.h"
#include "kernels/cuda_check.h"
#include "kernels/sm80/flash_bwd_dkv_kernel.cuh"
#include "kernels/sm80/flash_bwd_dq_kernel.cuh"
#include "kernels/sm80/flash_fwd_launch.cuh"
#include "kernels/sm80/flash_fwd_splitkv_kernel.cuh"
#ifdef TUNE_SM90
#include "kernels/sm90/flash_bwd_dkv_kernel.cuh"
#include "kernels/sm90/flash_bwd_dq_kernel.cuh"
#include "kernels/sm90/flash_fwd_launch.cuh"
#endif

struct TuneVariant {
  int kind;  // 0 fwd, 1 dkv, 2 dq, 3 split-KV forward (decode)
  int hdim;
  std::string name;
  std::function<void(flash::Flash_bwd_params&, cudaStream_t)> run;  // splitkv: split kernel + combine
  std::function<void(flash::Flash_bwd_params&, cudaStream_t)> run_split;  // splitkv: the split kernel alone
  std::function<int(const flash::Flash_fwd_params&)> heuristic;         // splitkv: num_splits for its row
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
// An sm90 backward kernel of tile shape Shape (parenthesized), as a Roles<> row if roles, its TMA
// loads allowed if tma (flash_bwd_{dkv,dq}_kernel.cuh: launch_bwd_dkv / launch_bwd_dq).
#define TUNE_SHAPE(...) __VA_ARGS__
#define TUNE_LAUNCH_BWD90(kind, Shape, roles, tma)                                                        \
  flash::sm90::launch_bwd_##kind<Bf16, HD,                                                                \
                                 std::conditional_t<bool(roles), flash::Roles<TUNE_SHAPE Shape>, TUNE_SHAPE Shape>>( \
      p, s, bool(tma))
#if KIND == 3
// The split-KV forward: SplitKvTileShape<BLOCK_N, warps, stages, Q-in-regs, min CTAs/SM, evict
// first, TMA>, launched as the library launches it, then the combine when split.
#ifndef A5
#define A5 false
#endif
#ifndef A6
#define A6 1
#endif
#ifndef A7
#define A7 0
#endif
using SkTile = flash::SplitKvTileShape<A1, A2, A3, bool(A5), A4, bool(A6), bool(A7)>;
using SkTraits = flash::sm80::SplitKvKernelTraits<Bf16, HD, SkTile>;
static TuneRegistrar tune_reg({3, HD,
                               "BN=" TUNE_STR(A1) " w=" TUNE_STR(A2) " st=" TUNE_STR(A3) " minB=" TUNE_STR(A4)
                               " qr=" TUNE_STR(A5) " ef=" TUNE_STR(A6) " tma=" TUNE_STR(A7),
                               [](flash::Flash_bwd_params& p, cudaStream_t s) {
                                 flash::sm80::launch_fwd_splitkv<SkTraits>(p, s);
                                 if (p.num_splits > 1) flash::run_splitkv_combine<Bf16>(p, s);
                               },
                               [](flash::Flash_bwd_params& p, cudaStream_t s) {
                                 flash::sm80::launch_fwd_splitkv<SkTraits>(p, s);
                               },
                               [](const flash::Flash_fwd_params& p) {
                                 return flash::num_splits_for_row(p, SkTraits::kBlockN, SkTraits::kSmemBytes,
                                                                  SkTraits::kMinBlocks, SkTraits::kNWarps);
                               }});
#elif KIND == 0 && defined(TUNE_SM90)
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
#elif KIND == 1 && defined(TUNE_SM90)  // A3..A7 always given (tune_kernels.py fills in the defaults)
// A7: the rows kernel's register diets and dS^T form (common/tile_shapes.h), bits 1 DpInS, 2 PSmem,
// 4 kRoundedPt (d96's production: long row 3, short row 4).
template <typename Shape, int kBits>
struct TuneDkvRow : Shape {
  static constexpr bool kDpInS = (kBits & 1) != 0, kPSmem = (kBits & 2) != 0, kRoundedPt = (kBits & 4) != 0;
};
static TuneRegistrar tune_reg({1, HD, "dkv90 BM=" TUNE_STR(A1) " BN=" TUNE_STR(A2) " split=" TUNE_STR(A3) " roles=" TUNE_STR(A4) " tma=" TUNE_STR(A5) " stages=" TUNE_STR(A6) " diet=" TUNE_STR(A7),
                               [](flash::Flash_bwd_params& p, cudaStream_t s) {
                                 TUNE_LAUNCH_BWD90(dkv, (TuneDkvRow<flash::DkvTileShape<A2, A1, A3, 16, true, A6>, A7>), A4, A5);
                               }});
#elif KIND == 2 && defined(TUNE_SM90)  // A3..A6 always given
static TuneRegistrar tune_reg({2, HD, "dq90 BM=" TUNE_STR(A1) " BN=" TUNE_STR(A2) " roles=" TUNE_STR(A3) " tma=" TUNE_STR(A4) " stages=" TUNE_STR(A5) " minB=" TUNE_STR(A6),
                               [](flash::Flash_bwd_params& p, cudaStream_t s) {
                                 TUNE_LAUNCH_BWD90(dq, (flash::DqTileShape<A1, A2, 16, true, A6, A5>), A3, A4);
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

// The sm90 forward's walk (flash.h; the library's rule lives in csrc/kernels/dispatch.cu, which the
// harness does not link): the harness's problems are dense, and dense calls take the persistent walk.
flash::Sm90FwdSchedule flash::sm90_fwd_schedule(const flash::Flash_fwd_params& params) {
  if (params.cu_seqlens_q != nullptr) {
    fprintf(stderr, "tune_kernels: dense problems only\n");
    exit(1);
  }
  return flash::kSm90FwdPersistent;
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
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float x = __bfloat162float(a[i]), y = __bfloat162float(b[i]), dxy = fabsf(x - y);
    m = fmaxf(m, dxy == dxy ? dxy : INFINITY);  // NaN (an unwritten, poisoned element) counts as inf
  }
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

// ---- Sustained load (--sustain=MS): the power-capped regime of long runs ----
// The harness's default timing (time_ms: 18 calls, tens of ms) runs at the boost clock; a training
// run or the benchmark's sweep holds the board at its power limit, where the SM clock follows the
// power each tile config draws (docs/PERF_NOTES.md, 2026-12-04 fifteenth session). With --sustain
// each point first runs the kernel back to back for MS ms, then times ~200 ms of calls while a host
// thread samples the SM clock and board power through NVML (the driver's libnvidia-ml, opened at
// run time: no link dependency; without it the clock columns read 0). NVML's power reading is a
// 1 s average on Hopper, so give MS >= 1000 for it to describe the variant timed.

// The NVML calls used, declared here (nvml.h is not part of every toolkit install).
struct Nvml {
  using Init = int (*)();
  using ByBus = int (*)(const char*, void**);
  using Clock = int (*)(void*, int, unsigned*);
  using Power = int (*)(void*, unsigned*);
  void* dev = nullptr;
  Clock clock = nullptr;
  Power power = nullptr;
  Nvml() {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!lib) return;
    auto init = reinterpret_cast<Init>(dlsym(lib, "nvmlInit_v2"));
    auto by_bus = reinterpret_cast<ByBus>(dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
    clock = reinterpret_cast<Clock>(dlsym(lib, "nvmlDeviceGetClockInfo"));
    power = reinterpret_cast<Power>(dlsym(lib, "nvmlDeviceGetPowerUsage"));
    char bus[32];
    int cuda_dev = 0;
    if (!init || !by_bus || !clock || !power || init() != 0 || cudaGetDevice(&cuda_dev) != cudaSuccess ||
        cudaDeviceGetPCIBusId(bus, sizeof bus, cuda_dev) != cudaSuccess || by_bus(bus, &dev) != 0) {
      dev = nullptr;
    }
  }
  // SM clock (MHz) and board power (W) now; zeros without NVML.
  void sample(double& mhz, double& watts) const {
    unsigned c = 0, mw = 0;
    if (dev && clock(dev, /*NVML_CLOCK_SM*/ 1, &c) == 0 && power(dev, &mw) == 0) mhz = c, watts = mw * 1e-3;
  }
};

struct Sustained {
  float ms;            // median ms per call in the timed window
  double mhz, watts;   // means of the samples taken while the timed calls ran
};

static Sustained time_sustained_ms(const std::function<void()>& fn, float sustain_ms, const Nvml& nvml) {
  cudaEvent_t a, b;
  FLASH_CHECK_CUDA(cudaEventCreate(&a));
  FLASH_CHECK_CUDA(cudaEventCreate(&b));
  FLASH_CHECK_CUDA(cudaEventRecord(a));
  for (int i = 0; i < 3; ++i) fn();
  FLASH_CHECK_CUDA(cudaEventRecord(b));
  FLASH_CHECK_CUDA(cudaEventSynchronize(b));
  float est = 0.f;
  FLASH_CHECK_CUDA(cudaEventElapsedTime(&est, a, b));
  est = std::max(est / 3, 1e-3f);
  const int heat = std::max(1, int(sustain_ms / est)), reps = std::max(15, int(200.f / est));
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) FLASH_CHECK_CUDA(cudaEventCreate(&e));
  // The sampler counts once the first timed call's start event is recorded and passed (an event
  // never recorded queries as complete).
  std::atomic<bool> armed{false}, done{false};
  double mhz_sum = 0, watts_sum = 0;
  int samples = 0;
  std::thread sampler([&] {
    while (!done.load()) {
      if (armed.load() && cudaEventQuery(ev[0]) == cudaSuccess) {
        double mhz = 0, watts = 0;
        nvml.sample(mhz, watts);
        mhz_sum += mhz, watts_sum += watts, ++samples;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  for (int i = 0; i < heat; ++i) fn();
  for (int i = 0; i < reps; ++i) {
    FLASH_CHECK_CUDA(cudaEventRecord(ev[2 * i]));
    if (i == 0) armed.store(true);
    fn();
    FLASH_CHECK_CUDA(cudaEventRecord(ev[2 * i + 1]));
  }
  FLASH_CHECK_CUDA(cudaEventSynchronize(ev.back()));
  done.store(true);
  sampler.join();
  std::vector<float> t(reps);
  for (int i = 0; i < reps; ++i) FLASH_CHECK_CUDA(cudaEventElapsedTime(&t[i], ev[2 * i], ev[2 * i + 1]));
  for (auto& e : ev) FLASH_CHECK_CUDA(cudaEventDestroy(e));
  FLASH_CHECK_CUDA(cudaEventDestroy(a));
  FLASH_CHECK_CUDA(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return {t[reps / 2], samples ? mhz_sum / samples : 0.0, samples ? watts_sum / samples : 0.0};
}

static const char* kind_name(const TuneVariant& v) { return v.kind == 0 ? "fwd" : v.kind == 1 ? "dkv" : "dq"; }

static double median(std::vector<double> x) {
  if (x.empty()) return 0.0;
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

// ---- Split-KV forward on decode steps (kind 3) ----

struct DecodeCase {
  int b, nk, page;  // batch, keys per sequence (the full cache), page size (0: contiguous)
  std::string name() const {
    return "B" + std::to_string(b) + "xN" + std::to_string(nk) + (page ? "xP" + std::to_string(page) : "");
  }
};

struct DecodeOptions {
  std::vector<int> splits = {0};  // 0: the variant's heuristic
  std::vector<DecodeCase> cases = {{1, 8192, 0},  {1, 131072, 0},  {8, 32768, 0},  {64, 8192, 0},
                                   {64, 32768, 0}, {1, 131072, 16}, {64, 32768, 16}};
  int h = 32, h_k = 8, reps = 0;  // reps 0: from the first estimate
  std::string csv;
};

// Comma list of ints / of cases "B1xN8192" or "B64xN32768xP16".
static std::vector<int> parse_ints(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p;) {
    v.push_back(atoi(p));
    while (*p && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return v;
}
static std::vector<DecodeCase> parse_cases(const char* s) {
  std::vector<DecodeCase> v;
  for (const char* p = s; *p;) {
    DecodeCase c{0, 0, 0};
    if (sscanf(p, "B%dxN%dxP%d", &c.b, &c.nk, &c.page) < 2) {
      fprintf(stderr, "bad case '%s': expected B<batch>xN<keys>[xP<page>]\n", p);
      exit(2);
    }
    v.push_back(c);
    while (*p && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return v;
}

// Reads n words (the "read" flush: L2 left holding clean lines of the buffer).
__global__ void read_words(const uint4* p, size_t n, float* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 w = p[i];
    acc ^= w.x ^ w.y ^ w.z ^ w.w;
  }
  if (acc == 0x9e3779b9u) *sink = 1.f;  // keeps the loads
}

// The L2 state before each timed call: FLASH_TUNE_FLUSH=zero (default: a 256 MB memset, L2 full of
// dirty lines, like flash_attn_ext/bench/timing.py's zero_()), read (a 256 MB read: clean lines),
// none (the inputs stay in L2 from the previous call where they fit).
static int flush_kind() {
  const char* e = getenv("FLASH_TUNE_FLUSH");
  return !e || !strcmp(e, "zero") ? 0 : !strcmp(e, "read") ? 1 : 2;
}

// Median ms of fn over `reps` calls, each after the flush of flush_kind(), CUDA events around the
// call only.
static float time_flushed_ms(const std::function<void()>& fn, void* flush, size_t flush_bytes, int reps) {
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) FLASH_CHECK_CUDA(cudaEventCreate(&e));
  const int kind = flush_kind();
  for (int i = 0; i < reps; ++i) {
    if (kind == 0) FLASH_CHECK_CUDA(cudaMemsetAsync(flush, 0, flush_bytes));
    if (kind == 1) {
      read_words<<<1056, 512>>>(static_cast<const uint4*>(flush), flush_bytes / 16,
                                static_cast<float*>(flush) + flush_bytes / 4 - 1);
      FLASH_CHECK_LAUNCH();
    }
    FLASH_CHECK_CUDA(cudaEventRecord(ev[2 * i]));
    fn();
    FLASH_CHECK_CUDA(cudaEventRecord(ev[2 * i + 1]));
  }
  FLASH_CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> t(reps);
  for (int i = 0; i < reps; ++i) FLASH_CHECK_CUDA(cudaEventElapsedTime(&t[i], ev[2 * i], ev[2 * i + 1]));
  for (auto& e : ev) FLASH_CHECK_CUDA(cudaEventDestroy(e));
  std::sort(t.begin(), t.end());
  return t[reps / 2];
}

static int run_decode(const DecodeOptions& opt, const cudaDeviceProp& prop, float* d_scratch) {
  std::vector<const TuneVariant*> vars;
  for (auto& v : tune_registry())
    if (v.kind == 3) vars.push_back(&v);
  if (vars.empty()) return 0;
  const int d = vars[0]->hdim, h = opt.h, h_k = opt.h_k;
  for (auto* v : vars) {
    if (v->hdim != d) { fprintf(stderr, "splitkv variants: one head dim per run\n"); return 1; }
  }
  // One cache buffer for every case: contiguous (b, nk, h_k, d) or, for paged cases, the same bytes
  // as (b nk / page, page, h_k, d) blocks reached through a shuffled block table.
  size_t cache_elems = 0, rows = 0;
  for (auto& c : opt.cases) {
    if (c.b < 1 || c.b > 1024 || c.nk < 1) {
      fprintf(stderr, "%s: batch 1..1024, N >= 1\n", c.name().c_str());
      return 1;
    }
    cache_elems = std::max(cache_elems, size_t(c.b) * c.nk * h_k * d);
    rows = std::max(rows, size_t(c.b) * h);
  }
  __nv_bfloat16 *k, *v, *q, *o, *ref;
  float *lse, *oaccum, *lseaccum;
  int *seqlens, *table;
  const size_t table_max = cache_elems / (size_t(h_k) * d) / 16;
  FLASH_CHECK_CUDA(cudaMalloc(&k, cache_elems * 2));
  FLASH_CHECK_CUDA(cudaMalloc(&v, cache_elems * 2));
  FLASH_CHECK_CUDA(cudaMalloc(&q, rows * d * 2));
  FLASH_CHECK_CUDA(cudaMalloc(&o, rows * d * 2));
  FLASH_CHECK_CUDA(cudaMalloc(&ref, rows * d * 2));
  FLASH_CHECK_CUDA(cudaMalloc(&lse, rows * 4));
  FLASH_CHECK_CUDA(cudaMalloc(&oaccum, size_t(flash::kMaxSplits) * rows * d * 4));
  FLASH_CHECK_CUDA(cudaMalloc(&lseaccum, size_t(flash::kMaxSplits) * rows * 4));
  FLASH_CHECK_CUDA(cudaMalloc(&seqlens, 1024 * 4));
  FLASH_CHECK_CUDA(cudaMalloc(&table, table_max * 4));
  const size_t flush_bytes = 256u << 20;
  void* flush;
  FLASH_CHECK_CUDA(cudaMalloc(&flush, flush_bytes));
  fill_random<<<4096, 256>>>(k, cache_elems, 11);
  fill_random<<<4096, 256>>>(v, cache_elems, 12);
  fill_random<<<1024, 256>>>(q, rows * d, 13);
  FLASH_CHECK_LAUNCH();

  FILE* csv = opt.csv.empty() ? nullptr : fopen(opt.csv.c_str(), "w");
  if (csv) fprintf(csv, "case,variant,splits,heuristic,ms,tbps,split_ms,combine_ms,maxdiff\n");
  printf("\nsplit-KV decode: GQA %d:%d, hd %d, bf16, seqlen_q 1, full cache; TB/s = K+V bytes / total ms; "
         "total = split kernel + combine, split = the split kernel alone (L2 flushed before each)\n", h, h_k, d);
  printf("%-16s %-50s %6s %9s %7s %9s %9s %9s\n", "case", "variant", "splits", "ms", "TB/s", "split_ms", "comb_ms",
         "maxdiff");
  // summary[case][variant] = (TB/s at the heuristic's splits, its splits, best TB/s, its splits)
  struct Cell { double heur = 0, best = 0, heur_ms = 0, heur_split_ms = 0; int heur_s = 0, best_s = 0; };
  std::vector<std::vector<Cell>> summary(opt.cases.size(), std::vector<Cell>(vars.size()));
  for (size_t ci = 0; ci < opt.cases.size(); ++ci) {
    const DecodeCase& c = opt.cases[ci];
    if (c.page && (c.page % 16 || c.nk % c.page)) {
      fprintf(stderr, "%s: page must be a multiple of 16 dividing N\n", c.name().c_str());
      return 1;
    }
    std::vector<int> lens(c.b, c.nk);
    FLASH_CHECK_CUDA(cudaMemcpy(seqlens, lens.data(), c.b * 4, cudaMemcpyHostToDevice));
    flash::Flash_bwd_params p;
    const int64_t kv_row = int64_t(h_k) * d;
    p.q.ptr = q, p.q.batch_stride = int64_t(h) * d, p.q.row_stride = int64_t(h) * d, p.q.head_stride = d;
    p.o = p.q, p.o.ptr = o;
    p.k.ptr = k, p.k.row_stride = kv_row, p.k.head_stride = d;
    p.k.batch_stride = c.page ? int64_t(c.page) * kv_row : int64_t(c.nk) * kv_row;
    p.v = p.k, p.v.ptr = v;
    if (c.page) {
      const int max_blocks = c.nk / c.page, nblocks = c.b * max_blocks;
      std::vector<int> perm(nblocks);
      for (int i = 0; i < nblocks; ++i) perm[i] = i;
      unsigned x = 12345;
      for (int i = nblocks - 1; i > 0; --i) {  // Fisher-Yates, fixed seed
        x = x * 1664525u + 1013904223u;
        std::swap(perm[i], perm[x % unsigned(i + 1)]);
      }
      FLASH_CHECK_CUDA(cudaMemcpy(table, perm.data(), size_t(nblocks) * 4, cudaMemcpyHostToDevice));
      p.block_table = table, p.block_table_batch_stride = max_blocks, p.page_size = c.page, p.num_blocks = nblocks;
    }
    p.h = h, p.h_k = h_k, p.h_h_k_ratio = h / h_k;
    p.b = c.b, p.seqlen_q = 1, p.seqlen_k = c.nk, p.d = p.d_rounded = d;
    p.scale_softmax = 1.0 / sqrt(double(d));
    p.scale_softmax_log2 = float(p.scale_softmax * 1.4426950408889634);
    p.is_causal = false, p.is_bf16 = true;
    p.arch = prop.major * 10 + prop.minor, p.num_sms = prop.multiProcessorCount, p.l2_bytes = prop.l2CacheSize;
    p.sm90_path = p.arch == 90;  // as dispatch.cu's select_arch on an sm_90a build: TMA rows take TMA
    p.cache_seqlens = seqlens;
    p.softmax_lse_ptr = lse, p.oaccum_ptr = oaccum, p.softmax_lseaccum_ptr = lseaccum;
    const size_t out_elems = size_t(c.b) * h * d;
    const double bytes = 2.0 * c.b * double(c.nk) * h_k * d * 2;
    bool have_ref = false;
    for (size_t vi = 0; vi < vars.size(); ++vi) {
      const TuneVariant& var = *vars[vi];
      const int heur = var.heuristic(p);
      std::vector<int> tried;
      for (int s : opt.splits) {
        const int ns = s == 0 ? heur : std::min(s, flash::kMaxSplits);
        if (std::find(tried.begin(), tried.end(), ns) != tried.end()) continue;
        tried.push_back(ns);
        p.num_splits = ns;
        FLASH_CHECK_CUDA(cudaMemset(o, 0xff, out_elems * 2));  // poison (NaN)
        var.run(p, nullptr);
        FLASH_CHECK_CUDA(cudaDeviceSynchronize());
        float md = 0.f;
        if (!have_ref) {
          FLASH_CHECK_CUDA(cudaMemcpy(ref, o, out_elems * 2, cudaMemcpyDeviceToDevice));
          have_ref = true;
          md = diff(o, o, out_elems, d_scratch);  // inf if the reference has a NaN (an unwritten element)
        } else {
          md = diff(o, ref, out_elems, d_scratch);
        }
        // Warm-up, then as many reps as ~100 ms allow (10..100).
        auto step = [&] { var.run(p, nullptr); };
        auto split_only = [&] { var.run_split(p, nullptr); };
        const float est = time_flushed_ms(step, flush, flush_bytes, 3);
        const int reps = opt.reps > 0 ? opt.reps : std::max(10, std::min(100, int(100.0 / (est + 0.1))));
        const float ms = time_flushed_ms(step, flush, flush_bytes, reps);
        const float split_ms = ns > 1 ? time_flushed_ms(split_only, flush, flush_bytes, reps) : ms;
        const double tbps = bytes / (ms * 1e-3) * 1e-12;
        const std::string label = std::to_string(ns) + (s == 0 ? "h" : "");
        printf("%-16s %-50s %6s %9.4f %7.3f %9.4f %9.4f %9.3g\n", c.name().c_str(), var.name.c_str(), label.c_str(), ms,
               tbps, split_ms, ms - split_ms, md);
        fflush(stdout);
        if (csv) {
          fprintf(csv, "%s,%s,%d,%d,%.5f,%.4f,%.5f,%.5f,%.4g\n", c.name().c_str(), var.name.c_str(), ns,
                  int(s == 0), ms, tbps, split_ms, ms - split_ms, md);
        }
        Cell& cell = summary[ci][vi];
        if (ns == heur) cell.heur = tbps, cell.heur_s = ns, cell.heur_ms = ms, cell.heur_split_ms = split_ms;
        if (tbps > cell.best) cell.best = tbps, cell.best_s = ns;
      }
    }
  }
  // Summary: per variant and case, TB/s at the heuristic's split count (its count) / the best
  // TB/s over the tried counts (its count).
  printf("\nsummary (TB/s): heuristic(splits) / best(splits)\n%-50s", "variant");
  for (auto& c : opt.cases) printf(" %-19s", c.name().c_str());
  printf("\n");
  for (size_t vi = 0; vi < vars.size(); ++vi) {
    printf("%-50s", vars[vi]->name.c_str());
    for (size_t ci = 0; ci < opt.cases.size(); ++ci) {
      const Cell& cell = summary[ci][vi];
      char buf[64];
      if (cell.heur > 0) snprintf(buf, sizeof buf, "%.2f(%d)/%.2f(%d)", cell.heur, cell.heur_s, cell.best, cell.best_s);
      else snprintf(buf, sizeof buf, "-/%.2f(%d)", cell.best, cell.best_s);
      printf(" %-19s", buf);
    }
    printf("\n");
  }
  // Where the first variant's time goes at its heuristic's split count.
  printf("\n%s at the heuristic's splits: total ms = split kernel + combine (incl. launch gap)\n",
         vars[0]->name.c_str());
  for (size_t ci = 0; ci < opt.cases.size(); ++ci) {
    const Cell& cell = summary[ci][0];
    if (cell.heur > 0) {
      printf("  %-16s splits %3d  total %8.4f  split %8.4f  combine %7.4f  %.2f TB/s\n", opt.cases[ci].name().c_str(),
             cell.heur_s, cell.heur_ms, cell.heur_split_ms, cell.heur_ms - cell.heur_split_ms, cell.heur);
    }
  }
  if (csv) fclose(csv);
  for (void* ptr : {static_cast<void*>(k), static_cast<void*>(v), static_cast<void*>(q), static_cast<void*>(o),
                    static_cast<void*>(ref), static_cast<void*>(lse), static_cast<void*>(oaccum),
                    static_cast<void*>(lseaccum), static_cast<void*>(seqlens), static_cast<void*>(table), flush}) {
    FLASH_CHECK_CUDA(cudaFree(ptr));
  }
  return 0;
}

int main(int argc, char** argv) {
  // Usage: tune_kernels [seqlen ...] [--splits=0,16,48] [--cases=B1xN8192,B64xN32768xP16]
  //                     [--heads=32:8] [--reps=N] [--csv=PATH] [--sustain=MS [--rounds=R]]
  // Dense kinds: seqlens (default 1024 4096 16384); hdims and causal from the registry; --sustain:
  // each point timed after MS ms of back-to-back calls, with the SM clock and power, in R rounds
  // of rotated order (time_sustained_ms). splitkv:
  // the decode cases (default: issue 14's five, plus page 16 at B1xN131072 and B64xN32768), each
  // at every split count of --splits (0: the variant's heuristic; default 0).
  std::vector<int> seqlens;
  DecodeOptions dec;
  float sustain_ms = 0.f;  // dense kinds: 0 = the short timing (time_ms); else time_sustained_ms
  int rounds = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--splits=", 0) == 0) dec.splits = parse_ints(argv[i] + 9);
    else if (a.rfind("--cases=", 0) == 0) dec.cases = parse_cases(argv[i] + 8);
    else if (a.rfind("--heads=", 0) == 0) sscanf(argv[i] + 8, "%d:%d", &dec.h, &dec.h_k);
    else if (a.rfind("--reps=", 0) == 0) dec.reps = atoi(argv[i] + 7);
    else if (a.rfind("--csv=", 0) == 0) dec.csv = a.substr(6);
    else if (a.rfind("--sustain=", 0) == 0) sustain_ms = float(atof(argv[i] + 10));
    else if (a.rfind("--rounds=", 0) == 0) rounds = std::max(1, atoi(argv[i] + 9));
    else seqlens.push_back(atoi(argv[i]));
  }
  if (seqlens.empty()) seqlens = {1024, 4096, 16384};
  cudaDeviceProp prop;
  FLASH_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  // fwd before dkv before dq; within a kind, link order (the driver's order: reference first).
  std::stable_sort(tune_registry().begin(), tune_registry().end(),
                   [](const TuneVariant& a, const TuneVariant& b) { return a.kind < b.kind; });
  std::vector<int> hdims;  // of the dense kinds
  for (auto& v : tune_registry())
    if (v.kind <= 2 && std::find(hdims.begin(), hdims.end(), v.hdim) == hdims.end()) hdims.push_back(v.hdim);
  std::sort(hdims.begin(), hdims.end());
  float* d_scratch;
  FLASH_CHECK_CUDA(cudaMalloc(&d_scratch, sizeof(float)));
  const Nvml nvml;
  if (sustain_ms > 0 && !nvml.dev) printf("note: NVML not available: no clock or power columns\n");
  if (!hdims.empty()) {
    printf("%-4s %-6s %-6s %-5s %-62s %9s %9s %10s\n", "hdim", "causal", "N", "kind", "variant", "ms", "TFLOP/s",
           "maxdiff");
  }
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
        // Share of the 2.5x-forward backward FLOPs: dkv does 4 of 7 matmuls, dq 3 of 7 (so TFLOP/s
        // of dkv and dq are comparable with each other and with fwd).
        auto flops_of = [&](const TuneVariant& var) {
          return var.kind == 0 ? fwd_flops : fwd_flops * (var.kind == 1 ? 2.0 : 1.5);
        };
        std::vector<std::pair<const TuneVariant*, float>> checked;  // (variant, maxdiff) in run order
        bool first[3] = {true, true, true};
        bool bwd_ready = false;
        const TuneVariant* fwd_ref = nullptr;
        for (auto& var : tune_registry()) {
          if (var.hdim != d || var.kind > 2) continue;
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
          checked.push_back({&var, md});
          if (sustain_ms > 0) continue;  // timed below, in rounds
          const float ms = time_ms([&] { var.run(p, nullptr); });
          printf("%-4d %-6s %-6d %-5s %-62s %9.3f %9.1f %10.3g\n", d, causal ? "yes" : "no", n, kind_name(var),
                 var.name.c_str(), ms, flops_of(var) / ms * 1e-9, md);
          fflush(stdout);
        }
        // Sustained: round r times every variant of the problem, in the order rotated by r (A B,
        // B A, ...), each after sustain_ms of back-to-back calls. Per round a line starting "round";
        // then per variant its median in the short timing's format (scripts/compare_tune.py reads
        // those) and a "clock" line: the medians of the rounds' SM clock, power and TFLOP/s per GHz.
        std::vector<std::vector<double>> tf(checked.size()), mhz(checked.size()), watts(checked.size());
        for (int r = 0; sustain_ms > 0 && r < rounds; ++r) {
          for (size_t j = 0; j < checked.size(); ++j) {
            const size_t vi = (j + r) % checked.size();
            const TuneVariant& var = *checked[vi].first;
            const Sustained t = time_sustained_ms([&] { var.run(p, nullptr); }, sustain_ms, nvml);
            tf[vi].push_back(flops_of(var) / t.ms * 1e-9);
            mhz[vi].push_back(t.mhz), watts[vi].push_back(t.watts);
            printf("round %d: %d %s %d %s %s  %.3f ms %.1f TFLOP/s %.0f MHz %.0f W\n", r, d, causal ? "yes" : "no", n,
                   kind_name(var), var.name.c_str(), t.ms, tf[vi].back(), t.mhz, t.watts);
            fflush(stdout);
          }
        }
        for (size_t vi = 0; sustain_ms > 0 && vi < checked.size(); ++vi) {
          const TuneVariant& var = *checked[vi].first;
          const double tflops = median(tf[vi]), clock = median(mhz[vi]);
          printf("%-4d %-6s %-6d %-5s %-62s %9.3f %9.1f %10.3g\n", d, causal ? "yes" : "no", n, kind_name(var),
                 var.name.c_str(), flops_of(var) / tflops * 1e-9, tflops, checked[vi].second);
          printf("  clock (median of %d rounds): %.0f MHz, %.0f W, %.1f TFLOP/s per GHz\n", rounds, clock,
                 median(watts[vi]), clock > 0 ? tflops / (clock * 1e-3) : 0.0);
        }
        fflush(stdout);
        for (auto* ptr : bufs) FLASH_CHECK_CUDA(cudaFree(ptr));
        for (void* ptr : {static_cast<void*>(lse), static_cast<void*>(stats), static_cast<void*>(ws),
                          static_cast<void*>(precise)}) {
          FLASH_CHECK_CUDA(cudaFree(ptr));
        }
      }
    }
  }
  return run_decode(dec, prop, d_scratch);
}
#endif
