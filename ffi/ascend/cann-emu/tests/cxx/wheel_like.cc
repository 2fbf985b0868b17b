// A C++ caller of the emulated HIXL written the way Mooncake's ascend_transport.so is: it
// make_shares the engine, builds the options map and the descriptor vector inline with its own
// libstdc++, and copies AscendStrings around. Built by tests/hixl_cxx.rs against
// cpp/ferry_hixl_abi.hpp (Ferry's own declarations) and linked against the emulator under the
// name libllm_datadist.so.
//
//   wheel_like server <adxl|hixl> <port>           prints "ready <src> <dst>", waits for "check"
//   wheel_like client <adxl|hixl> <server> <src> <dst>   reads src, writes dst, prints "done"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>

#include "ferry_hixl_abi.hpp"

extern "C" {
int aclrtSetDevice(int32_t device_id);
int aclrtMallocHost(void **ptr, size_t size);
int aclrtMalloc(void **ptr, size_t size, int policy);
int aclrtMemcpy(void *dst, size_t dst_max, const void *src, size_t count, int kind);
}

namespace {
constexpr size_t kLen = 256 * 1024;

uint8_t Pattern(uint32_t seed, size_t i) { return static_cast<uint8_t>((i * 7 + seed * 31) % 251); }

[[noreturn]] void Fail(const std::string &what, uint32_t code) {
  std::cout << "FAIL " << what << " " << code << std::endl;
  std::exit(1);
}

std::map<ge::AscendString, ge::AscendString> Options(bool cs) {
  std::map<ge::AscendString, ge::AscendString> options;
  options[ge::AscendString("AutoConnect")] = ge::AscendString(cs ? "1" : "0");
  options[ge::AscendString("adxl.BufferPool")] = ge::AscendString("0:0");
  if (cs) {
    options[ge::AscendString("adxl.LocalCommRes")] = ge::AscendString("{\"version\":\"1.3\"}");
  }
  // Copies made inline, as the wheel does.
  std::map<ge::AscendString, ge::AscendString> copy = options;
  return copy;
}

template <class Engine, class MemDesc, class OpDesc, class Op, class MemType>
int Server(const std::string &port, MemType host_type) {
  if (aclrtSetDevice(0) != 0) Fail("aclrtSetDevice", 0);
  auto engine = std::make_shared<Engine>();
  ge::AscendString name(("127.0.0.1:" + port).c_str());
  ge::AscendString name_copy = name;
  auto status = engine->Initialize(name_copy, Options(false));
  if (status != 0) Fail("server Initialize", status);
  void *src = nullptr;
  void *dst = nullptr;
  if (aclrtMallocHost(&src, kLen) != 0 || aclrtMallocHost(&dst, kLen) != 0) Fail("aclrtMallocHost", 0);
  for (size_t i = 0; i < kLen; ++i) {
    static_cast<uint8_t *>(src)[i] = Pattern(1, i);
    static_cast<uint8_t *>(dst)[i] = 0;
  }
  void *h1 = nullptr;
  void *h2 = nullptr;
  MemDesc d1{};
  d1.addr = reinterpret_cast<uintptr_t>(src);
  d1.len = kLen;
  MemDesc d2{};
  d2.addr = reinterpret_cast<uintptr_t>(dst);
  d2.len = kLen;
  if ((status = engine->RegisterMem(d1, host_type, h1)) != 0) Fail("RegisterMem src", status);
  if ((status = engine->RegisterMem(d2, host_type, h2)) != 0) Fail("RegisterMem dst", status);
  std::cout << "ready " << reinterpret_cast<uintptr_t>(src) << " " << reinterpret_cast<uintptr_t>(dst) << std::endl;
  std::string line;
  std::getline(std::cin, line);
  size_t bad = kLen;
  for (size_t i = 0; i < kLen; ++i) {
    if (static_cast<uint8_t *>(dst)[i] != Pattern(2, i)) {
      bad = i;
      break;
    }
  }
  std::cout << (bad == kLen ? "checked ok" : "checked bad at " + std::to_string(bad)) << std::endl;
  engine->Finalize();
  engine.reset();  // the destructor finalizes again
  return 0;
}

template <class Engine, class MemDesc, class OpDesc, class Op, class MemType>
int Client(const std::string &server, uintptr_t src, uintptr_t dst, Op read, Op write, MemType host_type) {
  if (aclrtSetDevice(0) != 0) Fail("aclrtSetDevice", 0);
  auto engine = std::make_shared<Engine>();
  auto status = engine->Initialize(ge::AscendString("127.0.0.1"), Options(false));
  if (status != 0) Fail("client Initialize", status);
  void *mine = nullptr;
  if (aclrtMallocHost(&mine, 2 * kLen) != 0) Fail("aclrtMallocHost", 0);
  uint8_t *bytes = static_cast<uint8_t *>(mine);
  for (size_t i = 0; i < kLen; ++i) {
    bytes[kLen + i] = Pattern(2, i);
  }
  void *h = nullptr;
  MemDesc d{};
  d.addr = reinterpret_cast<uintptr_t>(mine);
  d.len = 2 * kLen;
  if ((status = engine->RegisterMem(d, host_type, h)) != 0) Fail("RegisterMem", status);
  ge::AscendString remote(server.c_str());
  if ((status = engine->Connect(remote, 5000)) != 0) Fail("Connect", status);
  std::vector<OpDesc> reads;
  reads.push_back(OpDesc{reinterpret_cast<uintptr_t>(mine), src, kLen / 2});
  reads.push_back(OpDesc{reinterpret_cast<uintptr_t>(mine) + kLen / 2, src + kLen / 2, kLen / 2});
  if ((status = engine->TransferSync(remote, read, reads, 5000)) != 0) Fail("TransferSync READ", status);
  for (size_t i = 0; i < kLen; ++i) {
    if (bytes[i] != Pattern(1, i)) Fail("READ content at " + std::to_string(i), 0);
  }
  std::vector<OpDesc> writes{OpDesc{reinterpret_cast<uintptr_t>(mine) + kLen, dst, kLen}};
  if ((status = engine->TransferSync(remote, write, writes, 5000)) != 0) Fail("TransferSync WRITE", status);
  if ((status = engine->Disconnect(remote, 1000)) != 0) Fail("Disconnect", status);
  if ((status = engine->DeregisterMem(h)) != 0) Fail("DeregisterMem", status);
  engine->Finalize();
  std::cout << "done" << std::endl;
  return 0;
}
}  // namespace

int main(int argc, char **argv) {
  if (argc < 3) return 2;
  std::string role = argv[1];
  bool hixl_api = std::string(argv[2]) == "hixl";
  int32_t v = -1;
  if (adxl::AdxlEngine::GetCapability(adxl::CLIENT_SERVER_COMM, v) != 0 || v != 1) Fail("GetCapability", v);
  if (role == "server" && argc == 4) {
    return hixl_api ? Server<hixl::Hixl, hixl::MemDesc, hixl::TransferOpDesc, hixl::TransferOp>(argv[3], hixl::MEM_HOST)
                    : Server<adxl::AdxlEngine, adxl::MemDesc, adxl::TransferOpDesc, adxl::TransferOp>(argv[3], adxl::MEM_HOST);
  }
  if (role == "client" && argc == 6) {
    uintptr_t src = std::strtoull(argv[4], nullptr, 10);
    uintptr_t dst = std::strtoull(argv[5], nullptr, 10);
    return hixl_api ? Client<hixl::Hixl, hixl::MemDesc, hixl::TransferOpDesc>(argv[3], src, dst, hixl::READ, hixl::WRITE,
                                                                             hixl::MEM_HOST)
                    : Client<adxl::AdxlEngine, adxl::MemDesc, adxl::TransferOpDesc>(argv[3], src, dst, adxl::READ,
                                                                                   adxl::WRITE, adxl::MEM_HOST);
  }
  return 2;
}
