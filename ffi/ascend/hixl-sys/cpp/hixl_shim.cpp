// Ferry's C ABI over Huawei HIXL's C++ API (`hixl::Hixl` in libcann_hixl.so, the deprecated
// `adxl::AdxlEngine` in libllm_datadist.so, `ge::AscendString` in libmetadef.so).
//
// Ferry links none of these libraries. Rust loads them at run time, resolves the member
// functions by their mangled names and hands the addresses to this shim in a `FerryHixlFns`
// table. The shim does what Rust cannot do portably: it builds the C++ values HIXL's
// signatures take (`ge::AscendString`, `std::map<AscendString, AscendString>`,
// `std::vector<TransferOpDesc>`) with this compiler's libstdc++, calls the member functions
// through plain function pointers (Itanium C++ ABI: a non-static member function is a function
// whose first argument is `this`; a reference is passed as a pointer), and catches every C++
// exception so that none unwinds into Rust.
//
// Every declaration here is Ferry's own, written from the public documentation of the layouts
// (see docs/research/hixl-interop-facts.md); no vendor header is used or needed. The layouts
// Ferry relies on:
//   - ge::AscendString: one std::shared_ptr<std::string> (16 bytes), destroyed and copied
//     inline by its users; constructed by the library's `AscendString(const char*)`.
//   - Status: uint32_t. MemType, TransferOp, TransferStatus: int-sized enums. FeatureType: int32_t.
//   - MemDesc: {uintptr_t addr; size_t len; 128 bytes} = 144 bytes (hixl:: names the first of
//     the 128 bytes `bool local_only`; adxl:: reserves all of them; Ferry sends zeros).
//   - TransferOpDesc: {uintptr_t local_addr; uintptr_t remote_addr; size_t len} = 24 bytes.
//   - TransferArgs: 128 bytes, all zero (hixl:: starts it with `const void *user_data`).
//   - The engine object: one std::unique_ptr (8 bytes).
// std::shared_ptr, std::map and std::vector have the same layout under both libstdc++ string
// ABIs (_GLIBCXX_USE_CXX11_ABI 0 or 1); the shim never touches the std::string inside an
// AscendString, so it works with a library built under either.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

// HIXL's status codes (the subset the shim itself returns).
constexpr uint32_t kFailed = 503900U;

// The function types, as the Itanium C++ ABI passes the member functions' arguments.
using StringCtorFn = void (*)(void *self, const char *text);
using StringLessFn = bool (*)(const void *self, const void *other);
using EngineCtorFn = void (*)(void *self);
using EngineDtorFn = void (*)(void *self);
using InitializeFn = uint32_t (*)(void *self, const void *local_engine, const void *options);
using FinalizeFn = void (*)(void *self);
using RegisterMemFn = uint32_t (*)(void *self, const void *mem_desc, int mem_type, void **handle);
using DeregisterMemFn = uint32_t (*)(void *self, void *handle);
using ConnectFn = uint32_t (*)(void *self, const void *remote_engine, int32_t timeout_ms);
using TransferSyncFn = uint32_t (*)(void *self, const void *remote_engine, int op, const void *op_descs,
                                    int32_t timeout_ms);
using TransferAsyncFn = uint32_t (*)(void *self, const void *remote_engine, int op, const void *op_descs,
                                     const void *args, void **req);
using GetTransferStatusFn = uint32_t (*)(void *self, void *const *req, int *status);
using GetCapabilityFn = uint32_t (*)(int32_t feature, int32_t *value);

}  // namespace

extern "C" {

// The resolved addresses, filled in by Rust (`src/shim.rs`, same field order). The last three
// may be null (optional in HIXL, as Mooncake treats them).
struct FerryHixlFns {
  void *string_ctor;
  void *string_less;
  void *engine_ctor;
  void *engine_dtor;
  void *initialize;
  void *finalize;
  void *register_mem;
  void *deregister_mem;
  void *connect;
  void *disconnect;
  void *transfer_sync;
  void *transfer_async;
  void *get_transfer_status;
  void *get_capability;
};

// A C++ exception caught by the shim (`thrown != 0`), with its `what()` (truncated, NUL-terminated).
struct FerryHixlError {
  int32_t thrown;
  char what[256];
};

struct FerryHixlMemDesc {
  uintptr_t addr;
  size_t len;
  uint8_t local_only;
  uint8_t reserved[127];
};

struct FerryHixlOpDesc {
  uintptr_t local_addr;
  uintptr_t remote_addr;
  size_t len;
};

// The sizes the shim was built with (checked by Rust's tests).
struct FerryHixlLayout {
  size_t ascend_string;
  size_t options_map;
  size_t op_desc_vector;
  size_t mem_desc;
  size_t op_desc;
  size_t transfer_args;
  size_t engine_alloc;
};

}  // extern "C"

namespace {

using StringPtr = std::shared_ptr<std::string>;

// Ferry's stand-in for ge::AscendString: the same storage (one shared_ptr<std::string>),
// constructed by the library's own constructor, copied, moved and destroyed inline as the
// library's defaulted special members do.
class AscendStr {
 public:
  AscendStr(StringCtorFn ctor, const char *text) { ctor(storage_, text); }
  AscendStr(const AscendStr &other) { new (storage_) StringPtr(other.ptr()); }
  AscendStr(AscendStr &&other) noexcept { new (storage_) StringPtr(std::move(other.ptr())); }
  AscendStr &operator=(const AscendStr &) = delete;
  AscendStr &operator=(AscendStr &&) = delete;
  ~AscendStr() { ptr().~StringPtr(); }

  const void *raw() const { return storage_; }

 private:
  StringPtr &ptr() { return *std::launder(reinterpret_cast<StringPtr *>(storage_)); }
  const StringPtr &ptr() const { return *std::launder(reinterpret_cast<const StringPtr *>(storage_)); }

  alignas(StringPtr) unsigned char storage_[sizeof(StringPtr)];
};
static_assert(sizeof(AscendStr) == 16, "ge::AscendString is one std::shared_ptr");
static_assert(alignof(AscendStr) == alignof(void *), "ge::AscendString is pointer-aligned");

// The comparator of the options map. It must be an empty class, like std::less, so that the
// map has std::map<ge::AscendString, ge::AscendString>'s layout; it reaches the library's
// `operator<` through a thread-local set for the duration of one shim call.
thread_local StringLessFn tl_string_less = nullptr;

struct LessScope {
  explicit LessScope(StringLessFn f) : saved(tl_string_less) { tl_string_less = f; }
  ~LessScope() { tl_string_less = saved; }
  LessScope(const LessScope &) = delete;
  LessScope &operator=(const LessScope &) = delete;
  StringLessFn saved;
};

struct Less {
  bool operator()(const AscendStr &a, const AscendStr &b) const { return tl_string_less(a.raw(), b.raw()); }
};

using Options = std::map<AscendStr, AscendStr, Less>;
static_assert(sizeof(Options) == 48, "libstdc++'s std::map with an empty comparator");

using OpDescs = std::vector<FerryHixlOpDesc>;
static_assert(sizeof(OpDescs) == 3 * sizeof(void *), "std::vector is begin, end, capacity");
static_assert(sizeof(FerryHixlMemDesc) == 144, "MemDesc is 144 bytes");
static_assert(sizeof(FerryHixlOpDesc) == 24, "TransferOpDesc is 24 bytes");

// The 128 zero bytes of TransferArgs.
struct alignas(8) TransferArgs {
  unsigned char bytes[128];
};

// The engine is one unique_ptr (8 bytes); the rest of the allocation is a zeroed margin that
// costs nothing and keeps a release with a bigger object from writing past it.
constexpr std::size_t kEngineBytes = 64;
constexpr std::align_val_t kEngineAlign{16};

void record(FerryHixlError *err, const char *what) {
  if (err == nullptr) {
    return;
  }
  err->thrown = 1;
  std::size_t n = std::strlen(what);
  if (n >= sizeof(err->what)) {
    n = sizeof(err->what) - 1;
  }
  std::memcpy(err->what, what, n);
  err->what[n] = '\0';
}

// Runs `f`, turning any C++ exception into `kFailed` with `err` set.
template <class F>
uint32_t guarded(FerryHixlError *err, F &&f) noexcept {
  try {
    return f();
  } catch (const std::exception &e) {
    record(err, e.what());
  } catch (...) {
    record(err, "an exception that is not a std::exception");
  }
  return kFailed;
}

OpDescs to_vector(const FerryHixlOpDesc *descs, std::size_t n) {
  return n == 0 ? OpDescs() : OpDescs(descs, descs + n);
}

}  // namespace

extern "C" {

void ferry_hixl_layout(FerryHixlLayout *out) noexcept {
  out->ascend_string = sizeof(AscendStr);
  out->options_map = sizeof(Options);
  out->op_desc_vector = sizeof(OpDescs);
  out->mem_desc = sizeof(FerryHixlMemDesc);
  out->op_desc = sizeof(FerryHixlOpDesc);
  out->transfer_args = sizeof(TransferArgs);
  out->engine_alloc = kEngineBytes;
}

// Allocates an engine object and runs the constructor; `*engine` is set on success.
uint32_t ferry_hixl_engine_new(const FerryHixlFns *fns, void **engine, FerryHixlError *err) noexcept {
  *engine = nullptr;
  return guarded(err, [&]() -> uint32_t {
    void *mem = ::operator new(kEngineBytes, kEngineAlign);
    std::memset(mem, 0, kEngineBytes);
    try {
      reinterpret_cast<EngineCtorFn>(fns->engine_ctor)(mem);
    } catch (...) {
      ::operator delete(mem, kEngineAlign);
      throw;
    }
    *engine = mem;
    return 0;
  });
}

// Finalize (when `finalize_first`), then the destructor, then frees the object. An exception
// from Finalize is reported, and the destructor still runs.
void ferry_hixl_engine_delete(const FerryHixlFns *fns, void *engine, int32_t finalize_first,
                              FerryHixlError *err) noexcept {
  if (engine == nullptr) {
    return;
  }
  if (finalize_first != 0) {
    (void)guarded(err, [&]() -> uint32_t {
      reinterpret_cast<FinalizeFn>(fns->finalize)(engine);
      return 0;
    });
  }
  // A destructor is noexcept, so this guard is belt and braces; the first exception is the
  // one reported.
  FerryHixlError ignored{};
  FerryHixlError *dtor_err = (err != nullptr && err->thrown == 0) ? err : &ignored;
  (void)guarded(dtor_err, [&]() -> uint32_t {
    reinterpret_cast<EngineDtorFn>(fns->engine_dtor)(engine);
    return 0;
  });
  ::operator delete(engine, kEngineAlign);
}

uint32_t ferry_hixl_initialize(const FerryHixlFns *fns, void *engine, const char *local_engine,
                               const char *const *keys, const char *const *values, std::size_t n_options,
                               FerryHixlError *err) noexcept {
  return guarded(err, [&]() -> uint32_t {
    const auto ctor = reinterpret_cast<StringCtorFn>(fns->string_ctor);
    LessScope scope(reinterpret_cast<StringLessFn>(fns->string_less));
    AscendStr name(ctor, local_engine);
    Options options;
    for (std::size_t i = 0; i < n_options; ++i) {
      options.emplace(std::piecewise_construct, std::forward_as_tuple(ctor, keys[i]),
                      std::forward_as_tuple(ctor, values[i]));
    }
    return reinterpret_cast<InitializeFn>(fns->initialize)(engine, name.raw(), &options);
  });
}

void ferry_hixl_finalize(const FerryHixlFns *fns, void *engine, FerryHixlError *err) noexcept {
  (void)guarded(err, [&]() -> uint32_t {
    reinterpret_cast<FinalizeFn>(fns->finalize)(engine);
    return 0;
  });
}

uint32_t ferry_hixl_register_mem(const FerryHixlFns *fns, void *engine, const FerryHixlMemDesc *desc,
                                 int32_t mem_type, void **handle, FerryHixlError *err) noexcept {
  *handle = nullptr;
  return guarded(err, [&]() -> uint32_t {
    return reinterpret_cast<RegisterMemFn>(fns->register_mem)(engine, desc, mem_type, handle);
  });
}

uint32_t ferry_hixl_deregister_mem(const FerryHixlFns *fns, void *engine, void *handle,
                                   FerryHixlError *err) noexcept {
  return guarded(err, [&]() -> uint32_t {
    return reinterpret_cast<DeregisterMemFn>(fns->deregister_mem)(engine, handle);
  });
}

uint32_t ferry_hixl_connect(const FerryHixlFns *fns, void *engine, const char *remote_engine, int32_t timeout_ms,
                            FerryHixlError *err) noexcept {
  return guarded(err, [&]() -> uint32_t {
    AscendStr remote(reinterpret_cast<StringCtorFn>(fns->string_ctor), remote_engine);
    return reinterpret_cast<ConnectFn>(fns->connect)(engine, remote.raw(), timeout_ms);
  });
}

uint32_t ferry_hixl_disconnect(const FerryHixlFns *fns, void *engine, const char *remote_engine, int32_t timeout_ms,
                               FerryHixlError *err) noexcept {
  return guarded(err, [&]() -> uint32_t {
    AscendStr remote(reinterpret_cast<StringCtorFn>(fns->string_ctor), remote_engine);
    return reinterpret_cast<ConnectFn>(fns->disconnect)(engine, remote.raw(), timeout_ms);
  });
}

uint32_t ferry_hixl_transfer_sync(const FerryHixlFns *fns, void *engine, const char *remote_engine, int32_t op,
                                  const FerryHixlOpDesc *descs, std::size_t n_descs, int32_t timeout_ms,
                                  FerryHixlError *err) noexcept {
  return guarded(err, [&]() -> uint32_t {
    AscendStr remote(reinterpret_cast<StringCtorFn>(fns->string_ctor), remote_engine);
    const OpDescs v = to_vector(descs, n_descs);
    return reinterpret_cast<TransferSyncFn>(fns->transfer_sync)(engine, remote.raw(), op, &v, timeout_ms);
  });
}

uint32_t ferry_hixl_transfer_async(const FerryHixlFns *fns, void *engine, const char *remote_engine, int32_t op,
                                   const FerryHixlOpDesc *descs, std::size_t n_descs, void **req,
                                   FerryHixlError *err) noexcept {
  *req = nullptr;
  if (fns->transfer_async == nullptr) {
    record(err, "TransferAsync is not exported by the loaded library");
    return kFailed;
  }
  return guarded(err, [&]() -> uint32_t {
    AscendStr remote(reinterpret_cast<StringCtorFn>(fns->string_ctor), remote_engine);
    const OpDescs v = to_vector(descs, n_descs);
    const TransferArgs args{};
    return reinterpret_cast<TransferAsyncFn>(fns->transfer_async)(engine, remote.raw(), op, &v, &args, req);
  });
}

uint32_t ferry_hixl_get_transfer_status(const FerryHixlFns *fns, void *engine, void *req, int32_t *status,
                                        FerryHixlError *err) noexcept {
  *status = 3;  // FAILED, as HIXL itself reports on error
  if (fns->get_transfer_status == nullptr) {
    record(err, "GetTransferStatus is not exported by the loaded library");
    return kFailed;
  }
  return guarded(err, [&]() -> uint32_t {
    void *const request = req;
    int value = 3;
    const uint32_t rc = reinterpret_cast<GetTransferStatusFn>(fns->get_transfer_status)(engine, &request, &value);
    *status = value;
    return rc;
  });
}

uint32_t ferry_hixl_get_capability(const FerryHixlFns *fns, int32_t feature, int32_t *value,
                                   FerryHixlError *err) noexcept {
  *value = 0;
  if (fns->get_capability == nullptr) {
    record(err, "GetCapability is not exported by the loaded library");
    return kFailed;
  }
  return guarded(err, [&]() -> uint32_t {
    return reinterpret_cast<GetCapabilityFn>(fns->get_capability)(feature, value);
  });
}

}  // extern "C"
