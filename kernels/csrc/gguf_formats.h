// GGUF's block formats as the C++ kernels name them (kernels/gguf_quant.py: their
// layouts), shared by the fp32 path (quant_linear_cpu.cpp) and the int8 one
// (quant_int8_cpu.cpp).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace pagedserve_cpu {

enum class Format { kQ8_0, kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ4_K, kQ5_K, kQ6_K };

// Bytes per block: one home for the layouts' sizes (the kernels' strides and the op
// checks both take them from here).
template <Format F>
constexpr int block_bytes() {
  switch (F) {
    case Format::kQ8_0: return 34;
    case Format::kQ4_0: return 18;
    case Format::kQ4_1: return 20;
    case Format::kQ5_0: return 22;
    case Format::kQ5_1: return 24;
    case Format::kQ4_K: return 144;
    case Format::kQ5_K: return 176;
    case Format::kQ6_K: return 210;
  }
  return 0;
}

template <Format F>
constexpr int block_elems() {  // weights per block
  return F == Format::kQ4_K || F == Format::kQ5_K || F == Format::kQ6_K ? 256 : 32;
}

// The bytes of one weight row of K weights.
template <Format F>
constexpr int64_t row_bytes(int64_t K) {
  return K / block_elems<F>() * block_bytes<F>();
}

struct FormatInfo {
  Format format;
  int elems;  // weights per block
  int bytes;  // bytes per block
};

template <Format F>
constexpr FormatInfo info_of() {
  return {F, block_elems<F>(), block_bytes<F>()};
}

inline FormatInfo format_of(const std::string& name, const char* op) {
  if (name == "Q8_0") return info_of<Format::kQ8_0>();
  if (name == "Q4_0") return info_of<Format::kQ4_0>();
  if (name == "Q4_1") return info_of<Format::kQ4_1>();
  if (name == "Q5_0") return info_of<Format::kQ5_0>();
  if (name == "Q5_1") return info_of<Format::kQ5_1>();
  if (name == "Q4_K") return info_of<Format::kQ4_K>();
  if (name == "Q5_K") return info_of<Format::kQ5_K>();
  if (name == "Q6_K") return info_of<Format::kQ6_K>();
  TORCH_CHECK(false, op, ": GGUF format ", name, " is not decoded here");
}

// The format of a GGUF op's call (x [M, K] fp32 or bf16 with contiguous rows, data uint8
// [out_features, K / block * block_bytes]), after checking its arguments: an error
// names `op` and what is wrong.
inline FormatInfo checked_format(const at::Tensor& x, const at::Tensor& data, c10::string_view qtype,
                                 int64_t out_features, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [M, K] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": fp32 or bf16 x");
  const FormatInfo fi = format_of(std::string(qtype), op);
  const int64_t K = x.size(1);
  TORCH_CHECK(K % fi.elems == 0, op, ": K ", K, " is not a multiple of ", fi.elems);
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() && data.dim() == 2 &&
                  data.size(0) == out_features && data.size(1) == K / fi.elems * fi.bytes,
              op, ": data must be uint8 [out_features, K / ", fi.elems, " * ", fi.bytes, "]");
  return fi;
}

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// Q4_K / Q5_K's 6-bit (scale, min) of sub-block j (0-7) from the block's 12 scale bytes.
inline void k_scale_min(const uint8_t* s, int j, int* sc, int* mn) {
  *sc = j < 4 ? (s[j] & 0x3F) : ((s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30));
  *mn = j < 4 ? (s[j + 4] & 0x3F) : ((s[j + 4] >> 4) | ((s[j] >> 2) & 0x30));
}

// Calls f(std::integral_constant<Format, F>{}) for the runtime format: one template
// instance per format.
template <typename Fn>
void dispatch(Format format, Fn&& f) {
  switch (format) {
    case Format::kQ8_0: f(std::integral_constant<Format, Format::kQ8_0>{}); break;
    case Format::kQ4_0: f(std::integral_constant<Format, Format::kQ4_0>{}); break;
    case Format::kQ4_1: f(std::integral_constant<Format, Format::kQ4_1>{}); break;
    case Format::kQ5_0: f(std::integral_constant<Format, Format::kQ5_0>{}); break;
    case Format::kQ5_1: f(std::integral_constant<Format, Format::kQ5_1>{}); break;
    case Format::kQ4_K: f(std::integral_constant<Format, Format::kQ4_K>{}); break;
    case Format::kQ5_K: f(std::integral_constant<Format, Format::kQ5_K>{}); break;
    case Format::kQ6_K: f(std::integral_constant<Format, Format::kQ6_K>{}); break;
  }
}

}  // namespace pagedserve_cpu
