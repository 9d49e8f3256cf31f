// The side stream of the backward's dQ kernel (kernels/dispatch.cu: run_mha_bwd), host code only:
// the CUDA runtime's stream, event and capture-mode calls, no kernels. Its own header so that
// tests/test_bwd_fork.py can compile it against a mock runtime and drive every error path on a
// machine without a GPU.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda_check.h"

namespace flash {

// The backward's dK/dV and dQ kernels read the same inputs and the preprocess's workspaces and
// write disjoint outputs, so they may run side by side: dK/dV on the caller's stream, dQ on a side
// stream forked after the preprocess and joined back before the call returns (events; the pattern
// CUDA graph capture follows across streams). Each kernel's last, partial wave of CTAs then shares
// the GPU with the other kernel's CTAs instead of leaving SMs idle. The outputs' bits do not
// depend on it (each element is written once, in a fixed order, by one kernel).
// A side stream and its two events belong to one (host thread, device, caller's stream): a call's
// dQ then waits only for its own stream's earlier work (never another stream's), and no other
// thread re-records the events between this thread's record and wait. Up to kSlots of them per
// host thread, created on first use of a caller's stream, in a graph capture too (in the relaxed
// capture mode, so no capture of this thread or another is disturbed); past that, the two kernels
// run in sequence on the caller's stream.
class BwdFork {
 public:
  // Forks `stream` after the work queued on it so far (the preprocess); enabled = false: no fork.
  BwdFork(cudaStream_t stream, bool enabled) : stream_(stream) {
    if (!enabled) return;
    Slot* slot = find_or_create(stream);
    if (slot == nullptr) return;
    FLASH_CHECK_CUDA(cudaEventRecord(slot->forked, stream));
    FLASH_CHECK_CUDA(cudaStreamWaitEvent(slot->side, slot->forked, 0));
    slot_ = slot;
  }
  BwdFork(const BwdFork&) = delete;
  BwdFork& operator=(const BwdFork&) = delete;
  // Where the dQ kernel goes: the side stream, or the caller's when there is none.
  cudaStream_t dq_stream() const { return slot_ != nullptr ? slot_->side : stream_; }
  // The caller's stream waits for the side stream's work (checked calls; after the last launch).
  void join() {
    if (slot_ == nullptr) return;
    FLASH_CHECK_CUDA(cudaEventRecord(slot_->joined, slot_->side));
    FLASH_CHECK_CUDA(cudaStreamWaitEvent(stream_, slot_->joined, 0));
    slot_ = nullptr;  // (if a call above threw, the destructor tries once more)
  }
  // A launch threw before join(): join all the same (a capture must not end with the side stream
  // forked into it), unchecked, the error state cleared; the launch's exception goes on.
  ~BwdFork() {
    if (slot_ == nullptr) return;
    if (cudaEventRecord(slot_->joined, slot_->side) == cudaSuccess) {
      (void)cudaStreamWaitEvent(stream_, slot_->joined, 0);
    }
    (void)cudaGetLastError();
  }

 private:
  struct Slot {
    int device = -1;
    cudaStream_t stream = nullptr;  // the caller's stream this slot serves (with device)
    cudaStream_t side = nullptr;
    cudaEvent_t forked = nullptr, joined = nullptr;
    // Back to a free slot: at thread exit (work still queued on the side stream completes first),
    // or after a creation that failed half way; the runtime's error state is left clear (a later
    // launch check reads it).
    void release() {
      if (side == nullptr && forked == nullptr && joined == nullptr) return;
      cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
      const bool exchanged = cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess;
      if (forked != nullptr) (void)cudaEventDestroy(forked);
      if (joined != nullptr) (void)cudaEventDestroy(joined);
      if (side != nullptr) (void)cudaStreamDestroy(side);
      if (exchanged) (void)cudaThreadExchangeStreamCaptureMode(&mode);
      (void)cudaGetLastError();
      side = nullptr;
      forked = joined = nullptr;
    }
    ~Slot() { release(); }
  };
  static constexpr int kSlots = 48;  // torch's streams come from pools of 32 per device and priority

  // This thread's slot of (current device, stream), made on first use; nullptr: none (the slots
  // are taken, or the runtime refused: its error state then cleared).
  static Slot* find_or_create(cudaStream_t stream) {
    thread_local Slot slots[kSlots];
    int device = 0;
    FLASH_CHECK_CUDA(cudaGetDevice(&device));
    Slot* free_slot = nullptr;
    for (Slot& slot : slots) {
      if (slot.side != nullptr && slot.device == device && slot.stream == stream) return &slot;
      if (slot.side == nullptr && free_slot == nullptr) free_slot = &slot;
    }
    if (free_slot == nullptr) return nullptr;
    // Made in the relaxed capture mode, also while `stream` captures (a stream and two events are
    // no stream work: the capture then records the fork and join like any other's).
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    if (cudaThreadExchangeStreamCaptureMode(&mode) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    Slot& slot = *free_slot;
    const bool ok = cudaStreamCreateWithFlags(&slot.side, cudaStreamNonBlocking) == cudaSuccess &&
                    cudaEventCreateWithFlags(&slot.forked, cudaEventDisableTiming) == cudaSuccess &&
                    cudaEventCreateWithFlags(&slot.joined, cudaEventDisableTiming) == cudaSuccess;
    if (cudaThreadExchangeStreamCaptureMode(&mode) != cudaSuccess) (void)cudaGetLastError();
    if (!ok) {
      slot.release();  // what was made
      (void)cudaGetLastError();
      return nullptr;
    }
    slot.device = device;
    slot.stream = stream;
    return &slot;
  }

  cudaStream_t stream_;
  Slot* slot_ = nullptr;
};

}  // namespace flash
