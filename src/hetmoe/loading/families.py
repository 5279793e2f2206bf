"""What loading must know per supported family: checkpoint renames and config fields to fill in.

Names on disk are renamed into module space by one small table per family (regex, replacement),
applied in order; families whose checkpoints already use module names have an empty table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    """Loading facts of one `model_type`."""

    model_type: str
    """The config.json `model_type`."""
    renames: tuple[tuple[str, str], ...] = ()
    """(regex, replacement) pairs turning checkpoint names into module names, applied in order."""
    config_defaults: dict[str, Any] = field(default_factory=dict)
    """Config fields set when config.json lacks them (router semantics the HF class implies)."""

    def module_name(self, checkpoint_name: str) -> str:
        """The module-space name of a checkpoint tensor."""
        for pattern, replacement in self.renames:
            checkpoint_name = re.sub(pattern, replacement, checkpoint_name)
        return checkpoint_name


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("qwen2_moe"),
        Family("qwen3_moe"),
        # DeepseekV2Config writes topk_method but not scoring_func; V2 routes by softmax.
        Family("deepseek_v2", config_defaults={"scoring_func": "softmax"}),
        # DeepseekV3Config writes neither; its router is sigmoid + bias-corrected group top-k.
        Family(
            "deepseek_v3", config_defaults={"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
        ),
        Family(
            "mixtral",
            renames=(
                (r"\.block_sparse_moe\.", ".mlp."),
                (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
                (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."),
                (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."),
            ),
        ),
    )
}
"""Supported families by `model_type`."""
