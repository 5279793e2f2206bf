"""How GPU prefill computes streamed experts: the packed kernels on their bytes as they lie, or
an unpack to bf16 first. One rule for the streamer (engine/placement/layer_stream.py) and for
the GPU memory reserved for it (engine/placement/staging_plan.py): the unpack needs a bf16 copy
of the staged experts, the packed kernels none.
"""

from __future__ import annotations

import torch

from hetmoe import env
from hetmoe.kernels.packed_moe import unsupported


def unpack_reason(device: torch.device, fmt: str) -> str:
    """Why GPU prefill on `device` unpacks `fmt` experts to bf16 instead of running the packed
    kernels ("" when the packed kernels run): they cannot run there, or HETMOE_GPU_EXPERTS=unpack
    asks for the unpack."""
    why = unsupported(device, fmt)
    if why:
        return why
    if env.gpu_expert_kernel() == "unpack":
        return "HETMOE_GPU_EXPERTS=unpack"
    return ""
