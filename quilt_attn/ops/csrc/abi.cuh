// Host side: a parameter block's layout table, exported by the library so that a test can check Python's
// ctypes mirror of the block field by field (name, order, offset). FIELDS(X) lists the struct's fields in
// declaration order (QUILT_SM90_PARAMS_FIELDS, QUILT_PLAN_PARAMS_FIELDS).
#pragma once
#include <stddef.h>

#define QUILT_ABI_FIELD_NAME(f) #f ","
#define QUILT_ABI_FIELD_OFFSET(S, f) static_cast<int>(offsetof(S, f)),

namespace quilt_abi {

// true when the offsets rise: the field list is in declaration order
constexpr bool rising(const int* v, int n) { return n < 2 || (v[0] < v[1] && rising(v + 1, n - 1)); }

// *names = the fields, comma-separated; offsets[i] = field i's byte offset (up to cap); returns the count
template <int N>
int copy_layout(const char* fields, const int (&offs)[N], const char** names, int* offsets, int cap) {
  *names = fields;
  for (int i = 0; i < N && i < cap; ++i) offsets[i] = offs[i];
  return N;
}

}  // namespace quilt_abi
