"""Device tables of the multi-tensor kernels (h3lab.triton.squares, h3lab.triton.adamw): int64 rows of
addresses, sizes and strides that one launch reads to reach many tensors."""

from __future__ import annotations

import torch
from torch import Tensor


def on_device(values: list, device: torch.device) -> Tensor:
    """An int64 tensor of `values` on `device`; on CUDA through pinned memory, so the copy waits
    for neither the host nor the work queued before it."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
