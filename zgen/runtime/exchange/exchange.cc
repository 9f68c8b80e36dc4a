// A device-to-host mailbox for a compiled loop: zgen's decode loop hands each draw to the host and
// takes the host's answer (a grammar's token masks) with no Python callback and no host wait.
//
// Two XLA FFI handlers that only enqueue copies and stream memory operations on XLA's stream:
//   zgen_exchange_send(payload s32[n], sequence u32[]) -> ticket s32[]: copies the payload, then the
//       sequence number, into pinned host memory (the host polls the sequence number);
//   zgen_exchange_receive(after, ticket) -> s32[m]: waits until the host set the channel's ready
//       flag, clears it, then copies the host's answer in.
// `after` and `ticket` are never read: they order the receive after their producers (a value of the
// forward pass, and the last send). That data dependence is all that orders the two, so neither is
// declared side-effecting, which keeps jax's fast C++ dispatch for the loop that calls them.
// The host side (zgen/runtime/exchange/__init__.py) opens channels, waits for sends and answers.
// The CUDA driver is opened at run time, so this file builds with any C++17 compiler and XLA's
// FFI headers (no CUDA toolkit needed).

#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct CUstream_st;
using CUstream = CUstream_st*;
using CUdeviceptr = unsigned long long;
using CUresult = int;

struct Driver {
  CUresult (*mem_host_alloc)(void**, size_t, unsigned int) = nullptr;
  CUresult (*host_device_pointer)(CUdeviceptr*, void*, unsigned int) = nullptr;
  CUresult (*copy_to_host)(void*, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*copy_to_device)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
  CUresult (*wait_value)(CUstream, CUdeviceptr, uint32_t, unsigned int) = nullptr;
  CUresult (*write_value)(CUstream, CUdeviceptr, uint32_t, unsigned int) = nullptr;
  CUresult (*error_string)(CUresult, const char**) = nullptr;
  CUresult (*init)(unsigned int) = nullptr;
  CUresult (*device_get)(int*, int) = nullptr;
  CUresult (*primary_context)(void**, int) = nullptr;
  CUresult (*push_context)(void*) = nullptr;
  CUresult (*pop_context)(void**) = nullptr;
  std::string error;
};

template <typename F>
bool Load(void* lib, const char* name, const char* fallback, F* out) {
  void* f = dlsym(lib, name);
  if (f == nullptr && fallback != nullptr) f = dlsym(lib, fallback);
  *out = reinterpret_cast<F>(f);
  return f != nullptr;
}

const Driver& GetDriver() {
  static const Driver driver = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (lib == nullptr) {
      d.error = "the CUDA driver (libcuda.so.1) cannot be opened";
      return d;
    }
    bool ok = Load(lib, "cuMemHostAlloc", nullptr, &d.mem_host_alloc) &&
              Load(lib, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer", &d.host_device_pointer) &&
              Load(lib, "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync", &d.copy_to_host) &&
              Load(lib, "cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync", &d.copy_to_device) &&
              Load(lib, "cuStreamWaitValue32_v2", "cuStreamWaitValue32", &d.wait_value) &&
              Load(lib, "cuStreamWriteValue32_v2", "cuStreamWriteValue32", &d.write_value) &&
              Load(lib, "cuGetErrorString", nullptr, &d.error_string) && Load(lib, "cuInit", nullptr, &d.init) &&
              Load(lib, "cuDeviceGet", nullptr, &d.device_get) &&
              Load(lib, "cuDevicePrimaryCtxRetain", nullptr, &d.primary_context) &&
              Load(lib, "cuCtxPushCurrent_v2", "cuCtxPushCurrent", &d.push_context) &&
              Load(lib, "cuCtxPopCurrent_v2", "cuCtxPopCurrent", &d.pop_context);
    if (!ok) d.error = "the CUDA driver lacks a function the exchange needs";
    return d;
  }();
  return driver;
}

constexpr unsigned int kHostAllocPortable = 0x01, kHostAllocDeviceMap = 0x02;
constexpr unsigned int kWaitValueEq = 0x1, kWriteValueDefault = 0x0;

// One channel: pinned host memory the device writes to (inbox, sequence) and reads from (outbox),
// and the ready flag the device waits on. flags[0]: last sequence number sent; flags[1]: ready;
// flags[2]: the host asked its waiting thread to return.
struct Channel {
  int32_t* inbox = nullptr;
  int32_t* outbox = nullptr;
  uint32_t* flags = nullptr;
  CUdeviceptr ready_device = 0;  // the device's address of flags[1]
  int64_t inbox_words = 0, outbox_words = 0;
};

std::mutex channels_mutex;
std::vector<Channel> channels;

const Channel* Find(int64_t id) {
  std::lock_guard<std::mutex> lock(channels_mutex);
  return id >= 0 && id < static_cast<int64_t>(channels.size()) ? &channels[id] : nullptr;
}

ffi::Error Failed(const Driver& d, CUresult r, const char* what) {
  const char* text = "unknown error";
  if (d.error_string != nullptr) d.error_string(r, &text);
  return ffi::Error::Internal(std::string("zgen exchange: ") + what + " failed: " + text);
}

ffi::Error Send(CUstream stream, ffi::AnyBuffer payload, ffi::AnyBuffer sequence, ffi::Result<ffi::AnyBuffer> ticket,
                int64_t channel) {
  (void)ticket;
  const Driver& d = GetDriver();
  const Channel* c = Find(channel);
  if (c == nullptr) return ffi::Error::InvalidArgument("zgen exchange: no such channel");
  if (static_cast<int64_t>(payload.size_bytes()) > c->inbox_words * 4 || sequence.size_bytes() != 4)
    return ffi::Error::InvalidArgument("zgen exchange: the payload does not fit the channel's inbox");
  CUresult r = d.copy_to_host(c->inbox, reinterpret_cast<CUdeviceptr>(payload.untyped_data()), payload.size_bytes(), stream);
  if (r != 0) return Failed(d, r, "copying the payload to the host");
  r = d.copy_to_host(c->flags, reinterpret_cast<CUdeviceptr>(sequence.untyped_data()), 4, stream);
  if (r != 0) return Failed(d, r, "copying the sequence number to the host");
  return ffi::Error::Success();
}

ffi::Error Receive(CUstream stream, ffi::AnyBuffer after, ffi::AnyBuffer ticket, ffi::Result<ffi::AnyBuffer> answer,
                   int64_t channel) {
  (void)after;
  (void)ticket;
  const Driver& d = GetDriver();
  const Channel* c = Find(channel);
  if (c == nullptr) return ffi::Error::InvalidArgument("zgen exchange: no such channel");
  if (static_cast<int64_t>(answer->size_bytes()) > c->outbox_words * 4)
    return ffi::Error::InvalidArgument("zgen exchange: the answer does not fit the channel's outbox");
  CUresult r = d.wait_value(stream, c->ready_device, 1, kWaitValueEq);
  if (r != 0) return Failed(d, r, "waiting for the host's answer");
  r = d.write_value(stream, c->ready_device, 0, kWriteValueDefault);
  if (r != 0) return Failed(d, r, "clearing the ready flag");
  r = d.copy_to_device(reinterpret_cast<CUdeviceptr>(answer->untyped_data()), c->outbox, answer->size_bytes(), stream);
  if (r != 0) return Failed(d, r, "copying the host's answer to the device");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZgenExchangeSend, Send,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("channel"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZgenExchangeReceive, Receive,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("channel"));

// The host's side, through ctypes (which releases the GIL around each call).
extern "C" {

// Opens a channel of `inbox_words` and `outbox_words` int32 values for GPU `ordinal` (its primary
// context, which XLA uses); returns its id, or -1 and a reason in `error` (at most `error_size` bytes).
int64_t zgen_exchange_open(int64_t ordinal, int64_t inbox_words, int64_t outbox_words, char* error, int64_t error_size) {
  const Driver& d = GetDriver();
  auto fail = [&](const std::string& why) {
    std::snprintf(error, static_cast<size_t>(error_size), "%s", why.c_str());
    return int64_t{-1};
  };
  if (!d.error.empty()) return fail(d.error);
  int device = 0;
  void* context = nullptr;
  if (d.init(0) != 0 || d.device_get(&device, static_cast<int>(ordinal)) != 0 ||
      d.primary_context(&context, device) != 0 || d.push_context(context) != 0)
    return fail("GPU " + std::to_string(ordinal) + " has no usable CUDA context");
  struct Pop {
    const Driver& d;
    ~Pop() {
      void* ignored = nullptr;
      d.pop_context(&ignored);
    }
  } pop{d};
  Channel c;
  c.inbox_words = inbox_words;
  c.outbox_words = outbox_words;
  void* inbox = nullptr;
  void* outbox = nullptr;
  void* flags = nullptr;
  unsigned int how = kHostAllocPortable | kHostAllocDeviceMap;
  if (d.mem_host_alloc(&inbox, inbox_words * 4, how) != 0 || d.mem_host_alloc(&outbox, outbox_words * 4, how) != 0 ||
      d.mem_host_alloc(&flags, 64, how) != 0)
    return fail("pinned host memory could not be allocated");
  std::memset(flags, 0, 64);
  c.inbox = static_cast<int32_t*>(inbox);
  c.outbox = static_cast<int32_t*>(outbox);
  c.flags = static_cast<uint32_t*>(flags);
  CUdeviceptr flags_device = 0;
  if (d.host_device_pointer(&flags_device, flags, 0) != 0) return fail("the ready flag has no device address");
  c.ready_device = flags_device + 4;
  std::lock_guard<std::mutex> lock(channels_mutex);
  channels.push_back(c);
  return static_cast<int64_t>(channels.size()) - 1;
}

int32_t* zgen_exchange_inbox(int64_t id) { return Find(id) ? Find(id)->inbox : nullptr; }
int32_t* zgen_exchange_outbox(int64_t id) { return Find(id) ? Find(id)->outbox : nullptr; }

// Waits (spinning, then yielding) until the device sent a sequence number other than `last`;
// returns it, or `last` after `timeout_s` seconds or once zgen_exchange_wake was called.
uint32_t zgen_exchange_wait(int64_t id, uint32_t last, double timeout_s) {
  const Channel* c = Find(id);
  if (c == nullptr) return last;
  auto* sequence = reinterpret_cast<std::atomic<uint32_t>*>(c->flags);
  auto* woken = reinterpret_cast<std::atomic<uint32_t>*>(c->flags + 2);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (int spins = 0;; ++spins) {
    uint32_t now = sequence->load(std::memory_order_acquire);
    if (now != last) return now;
    if (woken->exchange(0, std::memory_order_acq_rel) != 0) return last;
    if (spins > 2000) {
      if (std::chrono::steady_clock::now() > deadline) return last;
      std::this_thread::yield();
    }
  }
}

// The outbox holds the answer: let the device's waiting receive go on.
void zgen_exchange_ready(int64_t id) {
  const Channel* c = Find(id);
  if (c == nullptr) return;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  reinterpret_cast<std::atomic<uint32_t>*>(c->flags + 1)->store(1, std::memory_order_release);
}

// Ends the current (or next) zgen_exchange_wait at once.
void zgen_exchange_wake(int64_t id) {
  const Channel* c = Find(id);
  if (c != nullptr) reinterpret_cast<std::atomic<uint32_t>*>(c->flags + 2)->store(1, std::memory_order_release);
}

// Clears the ready flag (before a loop starts: no answer from an earlier loop may be taken).
void zgen_exchange_reset(int64_t id, uint32_t sequence) {
  const Channel* c = Find(id);
  if (c == nullptr) return;
  reinterpret_cast<std::atomic<uint32_t>*>(c->flags + 1)->store(0, std::memory_order_release);
  reinterpret_cast<std::atomic<uint32_t>*>(c->flags + 2)->store(0, std::memory_order_release);
  reinterpret_cast<std::atomic<uint32_t>*>(c->flags)->store(sequence, std::memory_order_release);
}

}  // extern "C"
