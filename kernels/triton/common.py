"""What every Triton module here shares: whether the kernels run under the
interpreter (fixed at import, as the @triton.jit decorators are), the log2(e) of
the exp2-based softmax, and torch -> Triton dtypes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def interpreter_enabled() -> bool:
    """True when @triton.jit functions in this process run in the interpreter."""
    return bool(triton.knobs.runtime.interpret)


INTERPRET = interpreter_enabled()  # fixed at import, as the @triton.jit decorators below are


TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
