// A mock of the CUDA runtime calls csrc/kernels/bwd_fork.h and csrc/kernels/cuda_check.h make, for
// tests/cpp/bwd_fork_test.cpp (run by tests/test_bwd_fork.py on machines without a GPU). Every call
// is logged with its stream / event arguments; mock::fail_at makes the call of that index fail
// (returning an error and setting the thread's last error, as the runtime does); mock::capturing
// holds the streams that are capturing a graph. Streams and events are heap objects counted live.
#pragma once

#include <set>
#include <string>
#include <vector>

typedef int cudaError_t;
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorMock = 999;
struct MockStream {};
struct MockEvent {};
typedef MockStream* cudaStream_t;
typedef MockEvent* cudaEvent_t;
enum cudaStreamCaptureStatus { cudaStreamCaptureStatusNone = 0, cudaStreamCaptureStatusActive = 1 };
enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2
};
constexpr unsigned cudaStreamNonBlocking = 1, cudaEventDisableTiming = 2;

namespace mock {
struct Call {
  std::string name;
  const void* a;
  const void* b;
  cudaStreamCaptureMode mode;  // the calling thread's capture mode at the call
};
inline std::vector<Call> log;
inline int calls = 0, fail_at = -1, device = 0, live_streams = 0, live_events = 0;
inline std::set<const void*> capturing;
inline thread_local cudaError_t last_error = cudaSuccess;
inline thread_local cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;

inline cudaError_t call(const char* name, const void* a = nullptr, const void* b = nullptr) {
  log.push_back({name, a, b, mode});
  if (calls++ == fail_at) return last_error = cudaErrorMock;
  return cudaSuccess;
}
inline void reset(int fail = -1) {
  log.clear();
  calls = 0;
  fail_at = fail;
}
inline int count(const std::string& name) {
  int n = 0;
  for (const Call& c : log) n += c.name == name;
  return n;
}
}  // namespace mock

inline const char* cudaGetErrorString(cudaError_t) { return "mock error"; }
inline cudaError_t cudaGetLastError() {
  const cudaError_t e = mock::last_error;
  mock::last_error = cudaSuccess;
  return e;
}
inline cudaError_t cudaGetDevice(int* device) {
  *device = mock::device;
  return mock::call("cudaGetDevice");
}
inline cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  if (const cudaError_t e = mock::call("cudaStreamIsCapturing", s)) return e;
  *status = mock::capturing.count(s) ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
inline cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* m) {
  if (const cudaError_t e = mock::call("cudaThreadExchangeStreamCaptureMode")) return e;
  const cudaStreamCaptureMode old = mock::mode;
  mock::mode = *m;
  *m = old;
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  if (const cudaError_t e = mock::call("cudaStreamCreateWithFlags")) return e;
  *s = new MockStream;
  ++mock::live_streams;
  return cudaSuccess;
}
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  if (const cudaError_t err = mock::call("cudaEventCreateWithFlags")) return err;
  *e = new MockEvent;
  ++mock::live_events;
  return cudaSuccess;
}
inline cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete s;
  --mock::live_streams;
  return mock::call("cudaStreamDestroy", s);
}
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  --mock::live_events;
  return mock::call("cudaEventDestroy", e);
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) { return mock::call("cudaEventRecord", e, s); }
inline cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  return mock::call("cudaStreamWaitEvent", s, e);
}
