// The libstdc++ layout work behind the emulated HIXL/ADXL exports (module `hixl::abi`).
//
// Callers of HIXL build `ge::AscendString`, `std::map<AscendString, AscendString>` and
// `std::vector<TransferOpDesc>` inline with their own libstdc++, so the emulator must read and
// build exactly those layouts. Doing it in C++ with the same libstdc++ keeps the layouts right
// by construction. The types here live in Ferry's own namespace (never `ge::`/`adxl::`/`hixl::`,
// whose symbols the Rust side exports) and have the same layout as the real ones:
// `ge::AscendString` is one `std::shared_ptr<std::string>`; a map's layout does not depend on
// its (empty) comparator type.
//
// Every function is `noexcept`: no C++ exception crosses into Rust.

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <vector>

namespace ferry_cann_emu_hixl {

struct Str {
  std::shared_ptr<std::string> name;
};
static_assert(sizeof(Str) == 16, "an AscendString is one shared_ptr");

// The order of ge::AscendString::operator<: a null string sorts before any other, two null
// strings are equal, otherwise std::string's order (bytewise). (The null rule is an inference:
// an AscendString built from NULL holds no string.)
inline bool Less(const Str &a, const Str &b) {
  if (!a.name) {
    return static_cast<bool>(b.name);
  }
  if (!b.name) {
    return false;
  }
  return *a.name < *b.name;
}

struct StrLess {
  bool operator()(const Str &a, const Str &b) const { return Less(a, b); }
};

using Options = std::map<Str, Str, StrLess>;

struct OpDesc {
  uintptr_t local_addr;
  uintptr_t remote_addr;
  size_t len;
};
static_assert(sizeof(OpDesc) == 24, "TransferOpDesc is 24 bytes");

}  // namespace ferry_cann_emu_hixl

using ferry_cann_emu_hixl::OpDesc;
using ferry_cann_emu_hixl::Options;
using ferry_cann_emu_hixl::Str;

extern "C" {

// Constructs an AscendString in the 16 uninitialised bytes at `self` from `text` (NULL: an
// empty AscendString holding no string). Returns 0, or 1 when the allocation failed (then
// `self` holds an empty AscendString).
int ferry_cann_emu_hixl_str_new(void *self, const char *text) noexcept {
  Str *s = new (self) Str();
  if (text == nullptr) {
    return 0;
  }
  try {
    s->name = std::make_shared<std::string>(text);
  } catch (...) {
    return 1;
  }
  return 0;
}

// Destroys an AscendString built by ferry_cann_emu_hixl_str_new (tests only).
void ferry_cann_emu_hixl_str_drop(void *self) noexcept { static_cast<Str *>(self)->~Str(); }

// The bytes of an AscendString: returns 1 and sets data/len when it holds a string, 0 when
// it holds none.
int ferry_cann_emu_hixl_str_get(const void *self, const char **data, size_t *len) noexcept {
  const Str *s = static_cast<const Str *>(self);
  if (!s->name) {
    *data = nullptr;
    *len = 0;
    return 0;
  }
  *data = s->name->data();
  *len = s->name->size();
  return 1;
}

// operator< of two AscendStrings.
int ferry_cann_emu_hixl_str_less(const void *a, const void *b) noexcept {
  return ferry_cann_emu_hixl::Less(*static_cast<const Str *>(a), *static_cast<const Str *>(b)) ? 1 : 0;
}

// Calls `visit(ctx, key, value)` for each entry of a std::map<AscendString, AscendString>,
// in order. `visit` must not unwind.
void ferry_cann_emu_hixl_map_visit(const void *map, void (*visit)(void *, const void *, const void *),
                                   void *ctx) noexcept {
  const Options *m = static_cast<const Options *>(map);
  for (const auto &entry : *m) {
    visit(ctx, &entry.first, &entry.second);
  }
}

// The elements of a std::vector<TransferOpDesc>.
void ferry_cann_emu_hixl_vec_get(const void *vec, const void **data, size_t *len) noexcept {
  const std::vector<OpDesc> *v = static_cast<const std::vector<OpDesc> *>(vec);
  *data = v->data();
  *len = v->size();
}

// Test support: builds a std::map<AscendString, AscendString> of `n` pairs in `*out` (heap),
// and frees it. Returns 0, or 1 when an allocation failed.
int ferry_cann_emu_hixl_map_new(const char *const *keys, const char *const *values, size_t n, void **out) noexcept {
  try {
    std::unique_ptr<Options> m(new Options());
    for (size_t i = 0; i < n; ++i) {
      Str k;
      Str v;
      if (keys[i] != nullptr) k.name = std::make_shared<std::string>(keys[i]);
      if (values[i] != nullptr) v.name = std::make_shared<std::string>(values[i]);
      (*m)[k] = v;
    }
    *out = m.release();
  } catch (...) {
    return 1;
  }
  return 0;
}

void ferry_cann_emu_hixl_map_drop(void *map) noexcept { delete static_cast<Options *>(map); }

// Test support: a std::vector<TransferOpDesc> holding copies of `n` descriptors.
int ferry_cann_emu_hixl_vec_new(const OpDesc *descs, size_t n, void **out) noexcept {
  try {
    *out = new std::vector<OpDesc>(descs, descs + n);
  } catch (...) {
    return 1;
  }
  return 0;
}

void ferry_cann_emu_hixl_vec_drop(void *vec) noexcept { delete static_cast<std::vector<OpDesc> *>(vec); }

}  // extern "C"
