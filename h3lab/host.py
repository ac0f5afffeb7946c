"""Small host values onto a device without draining it.

`torch.tensor(values, device=cuda)` copies from pageable memory and waits for the copy, so for the
whole stream: a host sync that leaves the GPU idle until the host queues more. Through pinned memory
the copy is queued like a kernel (torch's pinned allocator keeps the buffer until the copy is done).
"""

from __future__ import annotations

import torch
from torch import Tensor


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A 1-D tensor of `values` in `dtype` on `device`; on CUDA through pinned memory, so the copy waits
    for neither the host nor the work queued before it (on a CPU: the tensor itself; another device:
    a plain copy)."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    host = torch.tensor(values, dtype=dtype)
    return host if device.type == "cpu" else host.to(device)
