// Ferry's own re-declaration of the C++ ABI of HIXL/ADXL (CANN >= 8.5) and of
// ge::AscendString, written from the published interface documentation and the
// symbols Mooncake's NPU wheel imports (docs/research/hixl-interop-facts.md).
// No vendor header was copied. Used by the emulator's tests (a C++ program built
// against libllm_datadist.so) and to derive the Itanium-mangled names with g++.
//
// Layouts that matter to inline callers:
//   ge::AscendString       one std::shared_ptr<std::string> (16 bytes)
//   adxl::AdxlEngine       one std::unique_ptr (8 bytes), caller-allocated
//   hixl::Hixl             one std::unique_ptr (8 bytes), caller-allocated
//   {adxl,hixl}::MemDesc   144 bytes (hixl: bool local_only at offset 16)
//   TransferOpDesc         24 bytes
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

struct aclrtMemFabricHandle;

namespace ge {
class AscendString {
 public:
  AscendString() = default;
  AscendString(const char *name);  // exported by the library
  bool operator<(const AscendString &other) const;  // exported by the library
  // Inline in every caller (not exported): reads the shared string.
  const char *GetString() const { return name_ ? name_->c_str() : ""; }

 private:
  std::shared_ptr<std::string> name_;
};
}  // namespace ge

namespace adxl {
using Status = uint32_t;
using AscendString = ge::AscendString;
using MemHandle = void *;
using TransferReq = void *;
enum MemType { MEM_DEVICE, MEM_HOST };
enum TransferOp { READ, WRITE };
enum FeatureType : int32_t { AUTO_CONNECT = 0, CLIENT_SERVER_COMM = 1 };
enum class TransferStatus { WAITING, COMPLETED, TIMEOUT, FAILED };
struct MemDesc {
  uintptr_t addr;
  size_t len;
  uint8_t reserved[128] = {};
};
struct TransferOpDesc {
  uintptr_t local_addr;
  uintptr_t remote_addr;
  size_t len;
};
struct TransferArgs {
  uint8_t reserved[128] = {};
};

class AdxlEngine {
 public:
  AdxlEngine();
  ~AdxlEngine();
  Status Initialize(const AscendString &local_engine, const std::map<AscendString, AscendString> &options);
  void Finalize();
  Status RegisterMem(const MemDesc &mem, MemType type, MemHandle &mem_handle);
  Status DeregisterMem(MemHandle mem_handle);
  Status Connect(const AscendString &remote_engine, int32_t timeout_in_millis = 1000);
  Status Disconnect(const AscendString &remote_engine, int32_t timeout_in_millis = 1000);
  Status TransferSync(const AscendString &remote_engine, TransferOp operation,
                      const std::vector<TransferOpDesc> &op_descs, int32_t timeout_in_millis = 1000);
  Status TransferAsync(const AscendString &remote_engine, TransferOp operation,
                       const std::vector<TransferOpDesc> &op_descs, const TransferArgs &optional_args,
                       TransferReq &req);
  Status GetTransferStatus(const TransferReq &req, TransferStatus &status);
  static Status MallocMem(MemType type, size_t size, void **ptr);
  static Status FreeMem(void *ptr);
  static Status GetCapability(FeatureType feature_type, int32_t &value);
  static Status ExportToShareableHandle(void *addr, aclrtMemFabricHandle &handle);

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};
}  // namespace adxl

namespace hixl {
using Status = uint32_t;
using AscendString = ge::AscendString;
using MemHandle = void *;
using TransferReq = void *;
enum MemType { MEM_DEVICE, MEM_HOST };
enum TransferOp { READ, WRITE };
enum FeatureType : int32_t { AUTO_CONNECT = 0, CLIENT_SERVER_COMM = 1 };
enum class TransferStatus { WAITING, COMPLETED, TIMEOUT, FAILED };
struct MemDesc {
  uintptr_t addr;
  size_t len;
  bool local_only = false;
  uint8_t reserved[127] = {};
};
struct TransferOpDesc {
  uintptr_t local_addr;
  uintptr_t remote_addr;
  size_t len;
};
struct TransferArgs {
  const void *user_data = nullptr;
  uint8_t reserved[120] = {};
};

class Hixl {
 public:
  Hixl();
  ~Hixl();
  Status Initialize(const AscendString &local_engine, const std::map<AscendString, AscendString> &options);
  void Finalize();
  Status RegisterMem(const MemDesc &mem, MemType type, MemHandle &mem_handle);
  Status DeregisterMem(MemHandle mem_handle);
  Status Connect(const AscendString &remote_engine, int32_t timeout_in_millis = 1000);
  Status Disconnect(const AscendString &remote_engine, int32_t timeout_in_millis = 1000);
  Status TransferSync(const AscendString &remote_engine, TransferOp operation,
                      const std::vector<TransferOpDesc> &op_descs, int32_t timeout_in_millis = 1000);
  Status TransferAsync(const AscendString &remote_engine, TransferOp operation,
                       const std::vector<TransferOpDesc> &op_descs, const TransferArgs &optional_args,
                       TransferReq &req);
  Status GetTransferStatus(const TransferReq &req, TransferStatus &status);
  static Status GetCapability(FeatureType feature_type, int32_t &value);

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};
}  // namespace hixl

static_assert(sizeof(ge::AscendString) == 16, "AscendString is one shared_ptr");
static_assert(sizeof(adxl::AdxlEngine) == 8, "AdxlEngine is one unique_ptr");
static_assert(sizeof(hixl::Hixl) == 8, "Hixl is one unique_ptr");
static_assert(sizeof(adxl::MemDesc) == 144, "adxl::MemDesc");
static_assert(sizeof(hixl::MemDesc) == 144, "hixl::MemDesc");
static_assert(offsetof(hixl::MemDesc, local_only) == 16, "hixl::MemDesc::local_only");
static_assert(sizeof(adxl::TransferOpDesc) == 24, "adxl::TransferOpDesc");
static_assert(sizeof(hixl::TransferArgs) == 128, "hixl::TransferArgs");
