// The op that switches weight_prefetch.h's prefetch (torch.ops.pagedserve_cpu):
// weight_prefetch_enable(bool) -> bool (was it on).

#include <torch/library.h>

#include "weight_prefetch.h"

namespace {

bool weight_prefetch_enable(bool on) { return pagedserve_cpu::g_weight_prefetch.exchange(on); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) { m.def("weight_prefetch_enable(bool on) -> bool", &weight_prefetch_enable); }
