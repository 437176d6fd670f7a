// The packed linear of linear_cpu.cpp, for the other kernels that multiply by packed
// weights (moe_cpu.cpp: each selected expert's gate-up and down projections).
#pragma once

#include <ATen/ATen.h>

namespace pagedserve_cpu {

// linear(x, packed, out_features, in_features, activation) of linear_cpu.cpp.
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, int64_t in_features,
                         c10::string_view activation);

}  // namespace pagedserve_cpu
