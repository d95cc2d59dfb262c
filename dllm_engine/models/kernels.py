"""Which kernels this torch and this device offer, decided on the host from shapes, dtypes and
versions (never from a device value), so a step's choice costs no synchronisation."""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor

GROUPED_MM_TORCH = (2, 9)  # F.grouped_mm with a CPU kernel (2.8 has the op on CUDA only)
GROUPED_MM_ALIGN = 16  # bytes: every stride and base address the grouped GEMM reads


def torch_at_least(floor: tuple[int, int], version: str = torch.__version__) -> bool:
    """Whether ``version`` (torch's, e.g. ``2.13.0+cpu``) is at least ``floor``, compared as
    numbers (as strings, "2.13" sorts before "2.5")."""
    numbers = version.split("+")[0].split(".")[:2]
    return tuple(int("".join(c for c in n if c.isdigit()) or 0) for n in numbers) >= floor


@lru_cache(maxsize=None)
def cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def aligned(t: Tensor) -> bool:
    size = t.element_size()
    return (t.data_ptr() % GROUPED_MM_ALIGN == 0
            and all(s == 1 or (s * size) % GROUPED_MM_ALIGN == 0 for s in t.stride()))


def grouped_mm_fits(tokens: Tensor, *weights: Tensor) -> bool:
    """Whether ``F.grouped_mm`` runs ``tokens`` [N, K] against each of ``weights`` [G, N_out, K]
    (stacked experts, transposed in the call) here: torch from 2.9, plain tensors of one
    floating dtype, 16-byte aligned strides; on a CPU in float32 / bfloat16 / float16, on CUDA
    in bfloat16 from compute capability 8.0 (from 9.0 its fused kernel takes the group ends on
    the device; below it torch's fallback reads them on the host). Elsewhere the caller runs one
    matmul chain per expert."""
    if not (torch_at_least(GROUPED_MM_TORCH) and hasattr(F, "grouped_mm")):
        return False
    tensors = (tokens, *weights)
    if any(type(t.data) is not Tensor or t.dtype != tokens.dtype for t in tensors):
        return False  # a quantized weight (a tensor subclass), or mixed dtypes
    device = tokens.device
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if tokens.dtype != torch.bfloat16 or cuda_capability(index) < (8, 0):
            return False
    elif device.type != "cpu" or tokens.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    width = GROUPED_MM_ALIGN // tokens.element_size()
    return (tokens.shape[-1] % width == 0 and all(w.shape[1] % width == 0 and w.shape[2] % width == 0 for w in weights)
            and aligned(tokens) and all(aligned(w) for w in weights))
