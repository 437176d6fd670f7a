// The fp32-activation GGUF linear of quant_linear_cpu.cpp, for quant_int8_cpu.cpp's
// batches (their x, quantized and scaled back to fp32, through its packed tiles).
#pragma once

#include <ATen/ATen.h>

namespace pagedserve_cpu {

// quant_linear(x, data, qtype, out_features) of quant_linear_cpu.cpp.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& data, c10::string_view qtype, int64_t out_features);

}  // namespace pagedserve_cpu
