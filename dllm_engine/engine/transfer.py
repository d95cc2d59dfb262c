"""Host arrays to the device and back: the one copy a step sends, the one read it makes. A leaf
module (numpy and torch only), so the step-plan types can use it without importing the engine."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def to_device(host: np.ndarray, device: torch.device) -> Tensor:
    """A host array on ``device``: a view on the CPU, one copy on a GPU that does not wait for
    the device (the array is staged at once; nothing writes it afterwards)."""
    return torch.from_numpy(host).to(device, non_blocking=True)


def host(x: Tensor | np.ndarray) -> np.ndarray:
    """``x`` as a host array (a tensor is read from its device: one host read)."""
    return x.detach().cpu().numpy() if isinstance(x, Tensor) else np.asarray(x)
