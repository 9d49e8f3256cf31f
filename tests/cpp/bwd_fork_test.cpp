// flash::BwdFork (csrc/kernels/bwd_fork.h) against the mock runtime of tests/cpp/mock_cuda: the fork
// and join's calls, one side stream per (host thread, device, caller's stream), made while the
// caller's stream captures too, the fallbacks (disabled, slots taken, any creation call failing)
// leaving no error state and the capture mode restored, the join when a launch throws, and every
// stream and event released at thread exit. Built and run by tests/test_bwd_fork.py; prints "ok"
// and exits 0, or names each failed check and exits 1.
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <thread>

#include "kernels/bwd_fork.h"

namespace {

int failures = 0;
#define CHECK(cond)                                                      \
  do {                                                                   \
    if (!(cond)) {                                                       \
      std::printf("FAILED line %d (case %s): %s\n", __LINE__, kase, #cond); \
      ++failures;                                                        \
    }                                                                    \
  } while (0)

const char* kase = "";
cudaStream_t caller(int i) { return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(0x1000 + 16 * i)); }

// The fork's calls in the log: index of the first call named `name` at or after `from` (-1: none).
int find(const char* name, size_t from = 0) {
  for (size_t i = from; i < mock::log.size(); ++i) {
    if (mock::log[i].name == name) return int(i);
  }
  return -1;
}

// A backward's host side: fork, the dK/dV launch (throws if asked), the dQ launch, join.
cudaStream_t backward(cudaStream_t stream, bool throw_in_launch = false) {
  flash::BwdFork fork(stream, true);
  const cudaStream_t dq = fork.dq_stream();
  if (throw_in_launch) throw std::runtime_error("launch");
  fork.join();
  return dq;
}

void run_all() {
  using flash::BwdFork;
  kase = "disabled";
  mock::reset();
  {
    BwdFork fork(caller(0), false);
    CHECK(fork.dq_stream() == caller(0));
    fork.join();
  }
  CHECK(mock::log.empty());

  kase = "first use: creation in the relaxed mode, fork, join";
  mock::reset();
  cudaStream_t side0 = nullptr;
  {
    BwdFork fork(caller(0), true);
    side0 = fork.dq_stream();
    CHECK(side0 != caller(0) && side0 != nullptr);
    CHECK(mock::count("cudaStreamCreateWithFlags") == 1 && mock::count("cudaEventCreateWithFlags") == 2);
    const int create = find("cudaStreamCreateWithFlags");
    CHECK(create >= 0 && mock::log[create].mode == cudaStreamCaptureModeRelaxed);
    const int rec = find("cudaEventRecord"), wait = find("cudaStreamWaitEvent");
    CHECK(rec >= 0 && wait > rec);
    CHECK(mock::log[rec].b == caller(0) && mock::log[wait].a == side0 && mock::log[wait].b == mock::log[rec].a);
    const size_t before = mock::log.size();
    fork.join();
    const int jrec = find("cudaEventRecord", before), jwait = find("cudaStreamWaitEvent", before);
    CHECK(jrec >= 0 && jwait > jrec && mock::log.size() == before + 2);
    CHECK(mock::log[jrec].b == side0 && mock::log[jwait].a == caller(0) && mock::log[jwait].b == mock::log[jrec].a);
    CHECK(mock::log[jrec].a != mock::log[rec].a);  // the join's event is not the fork's
  }
  CHECK(mock::count("cudaEventRecord") == 2);  // the destructor adds no second join
  CHECK(mock::mode == cudaStreamCaptureModeGlobal && mock::last_error == cudaSuccess);

  kase = "slots: per caller stream and device, reused";
  mock::reset();
  CHECK(backward(caller(0)) == side0);
  CHECK(mock::count("cudaStreamCreateWithFlags") == 0);
  const cudaStream_t side1 = backward(caller(1));
  CHECK(side1 != side0 && side1 != caller(1));
  mock::device = 1;
  const cudaStream_t side0_dev1 = backward(caller(0));
  CHECK(side0_dev1 != side0 && side0_dev1 != side1);
  mock::device = 0;
  CHECK(backward(caller(1)) == side1);

  kase = "a launch throws after the fork: the destructor joins";
  mock::reset();
  bool threw = false;
  try {
    backward(caller(0), true);
  } catch (const std::runtime_error&) {
    threw = true;
  }
  CHECK(threw);
  CHECK(mock::count("cudaEventRecord") == 2 && mock::count("cudaStreamWaitEvent") == 2);
  CHECK(mock::log.back().name == "cudaStreamWaitEvent" && mock::log.back().a == caller(0));
  CHECK(mock::last_error == cudaSuccess);

  kase = "the join's record fails: join throws, the destructor joins once more";
  mock::reset();
  threw = false;
  {
    BwdFork fork(caller(0), true);
    mock::fail_at = mock::calls;  // the next call: the join's cudaEventRecord
    try {
      fork.join();
    } catch (const std::runtime_error&) {
      threw = true;
    }
    (void)cudaGetLastError();  // the launch check's reading of it
  }
  CHECK(threw);
  CHECK(mock::count("cudaEventRecord") == 3 && mock::log.back().name == "cudaStreamWaitEvent");

  kase = "a capturing stream's first use: its side stream made in the relaxed mode, the fork captured";
  mock::reset();
  mock::capturing.insert(caller(2));
  const cudaStream_t side2 = backward(caller(2));
  CHECK(side2 != caller(2) && mock::count("cudaStreamCreateWithFlags") == 1);
  CHECK(mock::log[find("cudaStreamCreateWithFlags")].mode == cudaStreamCaptureModeRelaxed);
  CHECK(mock::count("cudaEventRecord") == 2 && mock::last_error == cudaSuccess);
  kase = "a capturing stream with a side stream made before: the fork is captured";
  CHECK(backward(caller(0)) == side0);  // (caller(0) not capturing here; its slot exists)
  mock::capturing.insert(caller(0));
  mock::reset();
  CHECK(backward(caller(0)) == side0 && mock::count("cudaStreamIsCapturing") == 0);
  mock::capturing.clear();

  kase = "each creation call failing in turn: in sequence, no leak, no error state, mode restored";
  for (int k = 0;; ++k) {
    const int streams = mock::live_streams, events = mock::live_events;
    mock::reset(k);
    cudaStream_t dq = nullptr;
    threw = false;
    try {
      dq = backward(caller(100 + k));
    } catch (const std::runtime_error&) {
      threw = true;
    }
    const std::string& failed = k < int(mock::log.size()) ? mock::log[k].name : std::string("none");
    if (failed == "cudaGetDevice" || failed == "cudaEventRecord" || failed == "cudaStreamWaitEvent") {
      CHECK(threw);  // checked calls: the error reaches the caller (nothing queued to join)
      (void)cudaGetLastError();
    } else if (failed != "none" && find("cudaEventRecord") < 0) {
      CHECK(!threw && dq == caller(100 + k));  // a creation call failed: in sequence
      CHECK(mock::live_streams == streams && mock::live_events == events);
    } else {
      CHECK(!threw && dq != caller(100 + k));  // the mode restore failed (error cleared), or none did
    }
    CHECK(mock::last_error == cudaSuccess);
    mock::mode = cudaStreamCaptureModeGlobal;  // (a failed restore leaves it relaxed: the runtime refused)
    if (failed == "none") break;
  }

  kase = "slots taken: in sequence past 48 caller streams per thread";
  mock::reset();
  int made = 0, sequential = 0;
  for (int i = 200; i < 260; ++i) {
    const cudaStream_t dq = backward(caller(i));
    made += dq != caller(i);
    sequential += dq == caller(i);
  }
  CHECK(made > 0 && sequential > 0 && mock::live_streams == 48);
  CHECK(mock::last_error == cudaSuccess);
}

}  // namespace

int main() {
  // On a thread of its own: its exit must release every side stream and event.
  std::thread t(run_all);
  t.join();
  kase = "thread exit";
  CHECK(mock::live_streams == 0 && mock::live_events == 0);
  for (const mock::Call& c : mock::log) {
    if (c.name == "cudaStreamDestroy") CHECK(c.mode == cudaStreamCaptureModeRelaxed);
  }
  if (failures == 0) std::printf("ok\n");
  return failures == 0 ? 0 : 1;
}
