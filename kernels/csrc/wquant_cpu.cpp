// Linear layers over the quantized safetensors weights (kernels/wquant.py's layouts,
// read as the loader keeps them: no repacked copy): y = x @ W.T for
//
//   int4  W[n, k] = (q - z[n, g]) * s[n, g], q packed two to a byte along k (low nibble
//         the even input), g = k / block_in: AWQ, GPTQ (without act-order) and
//         compressed-tensors pack-quantized all converge to this at load;
//   int8  W[n, k] = q * s[n / block_out, k / block_in] (per tensor, channel or tile);
//   fp8   the same with q an e4m3 byte, widened by bit arithmetic (below).
//
// Every weight is decoded exactly as the reference dequantizes it: the integer (or fp8
// value) made fp32 exactly (int4's zero point subtracted in integers), then one fp32
// multiply by its scale, which no add follows that could fuse it into an FMA. The
// decoded weights are therefore the reference's bit for bit (a test multiplies by the identity); the
// products with x are summed in a different order than torch's matmul, so the result
// is the reference's within fp32 rounding.
//
// Few rows of x (a decode step): a tile of kNR output rows by up to 2 rows of x; each
// 16 weights go from their bytes into two 8-lane fp32 registers and straight into the
// products, never written out. The weights are read once per call and stay 4-8x fewer
// bytes than fp32's, which is what a decode step's time is. An int4 byte holds inputs
// 2j and 2j+1, so x is copied once per call with each 16 inputs de-interleaved (even
// ones first): the low nibbles of 8 bytes then pair with 8 consecutive x lanes.
// More rows (a batch, a prefill): up to kBatchFloats weights at a time are decoded into an
// fp32 buffer (1 MB: the caches) and multiplied by all of x with at::mm (MKL's sgemm):
// decoding is paid once per weight per call, the GEMM runs at the dense kernel's pace.
//
// 8-lane GCC vectors: AVX2 registers, half an AVX-512 one (compiles and runs there),
// split by the compiler where the build has neither. The threads share the output rows out (work_pool.h).
//
// Op (torch.ops.pagedserve_cpu): wquant_linear(x, data, scale, zero, kind, block_out,
// block_in) -> y; x [M, K] fp32 or bf16 with contiguous rows; data uint8 [N, K / 2]
// (int4) or int8 / uint8 (fp8's bytes) [N, K]; scale fp32, fp16 or bf16
// [ceil(N / block_out), ceil(K / block_in)]; zero uint8 [N, K / block_in] for int4,
// else None; y [M, N] in x's dtype, rounded once from the fp32 sums.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "weight_prefetch.h"
#include "work_pool.h"

namespace {

using pagedserve_cpu::share_items;

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint8_t v8u8 __attribute__((vector_size(8)));
typedef int8_t v8s8 __attribute__((vector_size(8)));

enum class Kind { kInt4, kInt8, kFp8 };

constexpr int kChunk = 16;              // inputs decoded at a time: two vectors of 8
constexpr int kNR = 4;                  // output rows per few-rows tile: independent FMA chains
constexpr int64_t kBatchFrom = 8;       // rows of x from which decoding once into a buffer wins
// Decoded weights per GEMM call, at least 16 rows: 1 MB. Each at::mm call packs all of
// x again, so fewer, larger calls win: 576 x 1536 at 32 rows of x took 1.23x fp32's
// time with 256 KB chunks (L2), 1.09x with 1 MB.
constexpr int64_t kBatchFloats = 256 * 1024;

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline v8f bits_to_float(v8i bits) {
  v8f v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

inline float hsum(v8f v) {
  float lanes[8];
  std::memcpy(lanes, &v, sizeof lanes);
  return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

// e4m3 bytes -> their fp32 values: sign | exponent and mantissa moved into fp32's
// fields with the bias moved from 7 to 127 (normal numbers), m * 2^-9 (subnormals:
// exponent field 0), NaN at 0x7f / 0xff (e4m3fn has no infinities). All exact.
#if defined(__AVX2__)
// The bytes widen with one vpmovzx/vpmovsx (GCC's generic conversion of an 8-byte
// vector does not find it); everything else is the same arithmetic as the fallback.
inline v8i widen_u8(const uint8_t* p) {
  return (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline v8i widen_s8(const uint8_t* p) {
  return (v8i)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
#else
inline v8i widen_u8(const uint8_t* p) {
  v8u8 bytes;
  std::memcpy(&bytes, p, 8);
  return __builtin_convertvector(bytes, v8i);
}
inline v8i widen_s8(const uint8_t* p) {
  v8s8 bytes;
  std::memcpy(&bytes, p, 8);
  return __builtin_convertvector(bytes, v8i);
}
#endif

#if defined(__AVX2__)
// Whether none of 16 e4m3 bytes is a subnormal, zero or NaN: then each is sign |
// exponent | mantissa moved up by 20 bits (the sign-extended byte's bits above 26
// masked but the sign) plus the bias difference, which fp8_values' selects need not check.
inline bool fp8_all_normal(const uint8_t* p) {
  const __m128i mag = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), _mm_set1_epi8(0x7F));
  const __m128i tiny = _mm_cmpeq_epi8(_mm_and_si128(mag, _mm_set1_epi8(0x78)), _mm_setzero_si128());
  const __m128i nan = _mm_cmpeq_epi8(mag, _mm_set1_epi8(0x7F));
  return _mm_movemask_epi8(_mm_or_si128(tiny, nan)) == 0;
}

inline v8f fp8_normal_values(const uint8_t* p) {
  return bits_to_float(((widen_s8(p) << 20) & static_cast<int32_t>(0x87FFFFFF)) + (120 << 23));
}
#endif

inline v8f fp8_values(const uint8_t* p) {
  const v8i u = widen_u8(p);
  const v8i mag = u & 0x7F;
  const v8f normal = bits_to_float((mag << 20) + (120 << 23));
  const v8f subnormal = __builtin_convertvector(mag, v8f) * (1.0f / 512.0f);
  v8f v = mag < 8 ? subnormal : normal;
  v = mag == 0x7F ? v8f{} + std::numeric_limits<float>::quiet_NaN() : v;
  v8i bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits_to_float(bits | ((u & 0x80) << 24));
}

// The 16 weights of a row from input k on (k % 16 == 0), times their scale, as two
// vectors: int4 in de-interleaved order (even inputs, then odd), else in order.
template <Kind KD>
__attribute__((always_inline)) inline void decode16(const uint8_t* row, int64_t k, int32_t zero, float scale, v8f& a, v8f& b) {
  if constexpr (KD == Kind::kInt4) {
    const v8i u = widen_u8(row + k / 2);
    a = __builtin_convertvector((u & 0x0F) - zero, v8f) * scale;
    b = __builtin_convertvector((u >> 4) - zero, v8f) * scale;
  } else if constexpr (KD == Kind::kInt8) {
    a = __builtin_convertvector(widen_s8(row + k), v8f) * scale;
    b = __builtin_convertvector(widen_s8(row + k + 8), v8f) * scale;
  } else {
#if defined(__AVX2__)
    if (fp8_all_normal(row + k)) {
      a = fp8_normal_values(row + k) * scale;
      b = fp8_normal_values(row + k + 8) * scale;
      return;
    }
#endif
    a = fp8_values(row + k) * scale;
    b = fp8_values(row + k + 8) * scale;
  }
}

// Where a weight row's bytes, scales and zero points are.
template <typename S>
struct Weights {
  const uint8_t* data;
  int64_t row_bytes;
  const S* scale;
  int64_t scale_cols;
  const uint8_t* zero;  // int4: [N, scale_cols]; else null
  int64_t block_out, block_in, K;
};

// One weight row's bytes, scales and zero points (the divisions done once per row:
// an integer division per block would cost more than the block's decode).
template <typename S>
struct Row {
  const uint8_t* bytes = nullptr;
  const S* scale = nullptr;
  const uint8_t* zero = nullptr;

  Row() = default;
  Row(const Weights<S>& w, int64_t n)
      : bytes(w.data + n * w.row_bytes),
        scale(w.scale + (n / w.block_out) * w.scale_cols),
        zero(w.zero ? w.zero + n * w.scale_cols : nullptr) {}
  float scale_of(int64_t block) const { return static_cast<float>(scale[block]); }
  int32_t zero_of(int64_t block) const { return zero ? zero[block] : 0; }
};

// y rows m0..m0+MR, outputs n0..n0+NR (NR <= kNR): each 16 weights decoded once into
// registers and multiplied by MR rows of x.
template <Kind KD, int MR, int NR, typename S>
void rows_tile(const Weights<S>& w, const float* xs, int64_t m0, int64_t n0, float* out /* [MR][NR] */) {
  const int64_t K = w.K;
  Row<S> rows[NR];
  for (int n = 0; n < NR; ++n) rows[n] = Row<S>(w, n0 + n);
  v8f acc[MR][NR] = {};
  for (int64_t block = 0, k0 = 0; k0 < K; ++block, k0 += w.block_in) {
    const int64_t k1 = std::min(K, k0 + w.block_in);
    float s[NR];
    int32_t z[NR];
    for (int n = 0; n < NR; ++n) s[n] = rows[n].scale_of(block), z[n] = rows[n].zero_of(block);
    for (int64_t k = k0; k < k1; k += kChunk) {
      // INT4 is bound by its decode, not by memory: there the prefetch measured 0.90-1.18x.
      if constexpr (KD != Kind::kInt4)
        pagedserve_cpu::prefetch_ahead(rows[0].bytes, NR * w.row_bytes, k / kChunk, K / kChunk);
      for (int n = 0; n < NR; ++n) {
        v8f a, b;
        decode16<KD>(rows[n].bytes, k, z[n], s[n], a, b);
        for (int m = 0; m < MR; ++m) {
          const float* xm = xs + (m0 + m) * K + k;
          acc[m][n] += load8(xm) * a + load8(xm + 8) * b;
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) out[m * NR + n] = hsum(acc[m][n]);
}

template <typename T>
inline void store(T* y, float v) {
  *y = static_cast<T>(v);  // c10::BFloat16 rounds to nearest even, as torch does
}

template <Kind KD, int MR, int NR, typename S, typename T>
void rows_tile_into(const Weights<S>& w, const float* xs, int64_t m0, int64_t n0, T* y, int64_t N) {
  float out[MR * NR];
  rows_tile<KD, MR, NR>(w, xs, m0, n0, out);
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) store(y + (m0 + m) * N + n0 + n, out[m * NR + n]);
}

template <Kind KD, typename S, typename T>
void run_rows(const Weights<S>& w, const float* xs, int64_t M, int64_t N, T* y) {
  share_items((N + kNR - 1) / kNR, kNR * w.K * M, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * kNR;
      const bool whole = n0 + kNR <= N;
      int64_t m = 0;
      for (; m + 2 <= M; m += 2) {
        if (whole)
          rows_tile_into<KD, 2, kNR>(w, xs, m, n0, y, N);
        else
          for (int64_t n = n0; n < N; ++n) rows_tile_into<KD, 2, 1>(w, xs, m, n, y, N);
      }
      for (; m < M; ++m) {
        if (whole)
          rows_tile_into<KD, 1, kNR>(w, xs, m, n0, y, N);
        else
          for (int64_t n = n0; n < N; ++n) rows_tile_into<KD, 1, 1>(w, xs, m, n, y, N);
      }
    }
  });
}

// Weight rows n0..n0+rows decoded into out [rows][K] (int4 de-interleaved, like x).
template <Kind KD, typename S>
void decode_rows(const Weights<S>& w, int64_t n0, int64_t rows, float* out) {
  const int64_t K = w.K;
  for (int64_t r = 0; r < rows; ++r) {
    const Row<S> row(w, n0 + r);
    for (int64_t block = 0, k0 = 0; k0 < K; ++block, k0 += w.block_in) {
      const int64_t k1 = std::min(K, k0 + w.block_in);
      const float s = row.scale_of(block);
      const int32_t z = row.zero_of(block);
      for (int64_t k = k0; k < k1; k += kChunk) {
        v8f a, b;
        decode16<KD>(row.bytes, k, z, s, a, b);
        std::memcpy(out + r * K + k, &a, sizeof a);
        std::memcpy(out + r * K + k + 8, &b, sizeof b);
      }
    }
  }
}

template <Kind KD, typename S>
void run_batch(const Weights<S>& w, const at::Tensor& xs, int64_t N, at::Tensor& y32) {
  const int64_t K = w.K;
  // As many rows as fit the budget: each GEMM call packs all of x again.
  const int64_t chunk = std::max<int64_t>(16, kBatchFloats / K / 8 * 8);
  at::parallel_for(0, (N + chunk - 1) / chunk, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> buffer(static_cast<size_t>(chunk * K));
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * chunk;
      const int64_t rows = std::min(chunk, N - n0);
      decode_rows<KD>(w, n0, rows, buffer.data());
      const at::Tensor decoded = at::from_blob(buffer.data(), {rows, K}, xs.options());
      y32.narrow(1, n0, rows).copy_(at::mm(xs, decoded.t()));
    }
  });
}

// x as fp32 rows of K, int4's inputs de-interleaved within each 16.
at::Tensor activations(const at::Tensor& x, Kind kind) {
  at::Tensor xs = x.to(at::kFloat).contiguous();
  if (kind != Kind::kInt4) return xs;
  const int64_t M = xs.size(0), K = xs.size(1);
  return xs.view({M, K / kChunk, kChunk / 2, 2}).transpose(2, 3).contiguous().view({M, K});
}

Kind kind_of(c10::string_view kind) {
  if (kind == "int4") return Kind::kInt4;
  if (kind == "int8") return Kind::kInt8;
  TORCH_CHECK(kind == "fp8", "wquant_linear: kind must be int4, int8 or fp8, not ", std::string(kind));
  return Kind::kFp8;
}

at::Tensor wquant_linear(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scale,
                         const c10::optional<at::Tensor>& zero, c10::string_view kind_name, int64_t block_out,
                         int64_t block_in) {
  const Kind kind = kind_of(kind_name);
  TORCH_CHECK(x.dim() == 2, "wquant_linear: x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "wquant_linear: fp32 or bf16 x");
  const int64_t M = x.size(0), K = x.size(1), N = data.size(0);
  block_in = std::min(block_in, K);
  TORCH_CHECK(K % kChunk == 0 && block_in > 0 && block_in % kChunk == 0 && block_out > 0,
              "wquant_linear: K ", K, " and block_in ", block_in, " must be multiples of ", kChunk);
  const int64_t row_bytes = kind == Kind::kInt4 ? K / 2 : K;
  TORCH_CHECK(data.dim() == 2 && data.is_contiguous() && data.element_size() == 1 && data.size(1) == row_bytes,
              "wquant_linear: data must be one-byte [N, ", row_bytes, "]");
  const int64_t scale_cols = (K + block_in - 1) / block_in;
  TORCH_CHECK(scale.dim() == 2 && scale.is_contiguous() && scale.size(0) == (N + block_out - 1) / block_out &&
                  scale.size(1) == scale_cols,
              "wquant_linear: scale must be [ceil(N / block_out), ceil(K / block_in)]");
  const bool int4 = kind == Kind::kInt4;
  TORCH_CHECK(int4 == zero.has_value(), "wquant_linear: int4 takes zero points, int8 and fp8 none");
  if (int4)
    TORCH_CHECK(block_out == 1 && zero->scalar_type() == at::kByte && zero->is_contiguous() &&
                    zero->sizes() == scale.sizes(),
                "wquant_linear: int4 zero points must be uint8 like scale [N, groups], block_out 1");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const at::Tensor xs = activations(x, kind);
  const auto go = [&](auto kind_tag, auto scale_tag) {
    constexpr Kind KD = decltype(kind_tag)::value;
    using S = decltype(scale_tag);
    const Weights<S> w{static_cast<const uint8_t*>(data.data_ptr()), row_bytes, scale.data_ptr<S>(), scale_cols,
                       int4 ? zero->data_ptr<uint8_t>() : nullptr, block_out, block_in, K};
    if (M >= kBatchFrom) {
      at::Tensor y32 = x.scalar_type() == at::kFloat ? y : at::empty({M, N}, xs.options());
      run_batch<KD>(w, xs, N, y32);
      if (!y32.is_same(y)) y.copy_(y32);
    } else if (x.scalar_type() == at::kFloat) {
      run_rows<KD>(w, xs.data_ptr<float>(), M, N, y.data_ptr<float>());
    } else {
      run_rows<KD>(w, xs.data_ptr<float>(), M, N, y.data_ptr<c10::BFloat16>());
    }
  };
  const auto with_scale = [&](auto kind_tag) {
    switch (scale.scalar_type()) {
      case at::kFloat: return go(kind_tag, float{});
      case at::kHalf: return go(kind_tag, c10::Half{});
      case at::kBFloat16: return go(kind_tag, c10::BFloat16{});
      default: TORCH_CHECK(false, "wquant_linear: scale must be fp32, fp16 or bf16, not ", scale.scalar_type());
    }
  };
  switch (kind) {
    case Kind::kInt4: with_scale(std::integral_constant<Kind, Kind::kInt4>{}); break;
    case Kind::kInt8: with_scale(std::integral_constant<Kind, Kind::kInt8>{}); break;
    case Kind::kFp8: with_scale(std::integral_constant<Kind, Kind::kFp8>{}); break;
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def(
      "wquant_linear(Tensor x, Tensor data, Tensor scale, Tensor? zero, str kind, int block_out, int block_in) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("wquant_linear", &wquant_linear); }
