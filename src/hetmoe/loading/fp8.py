"""An FP8 checkpoint's block scheme read from config.json's `quantization_config`."""

from __future__ import annotations

from typing import Any

from hetmoe.experts.fp8_weight import Fp8Scheme
from hetmoe.loading.errors import CheckpointError


def fp8_scheme(quantization_config: Any, where: str) -> Fp8Scheme:
    """The scheme of a `quantization_config` with `quant_method: fp8` and a block size."""
    qc = quantization_config if isinstance(quantization_config, dict) else vars(
        quantization_config
    )
    method = qc.get("quant_method")
    block = qc.get("weight_block_size")
    if method != "fp8" or not (isinstance(block, list | tuple) and len(block) == 2):
        raise CheckpointError(
            f"{where}: quantization_config must have quant_method 'fp8' and "
            f"weight_block_size [rows, cols]; found quant_method={method!r}, "
            f"weight_block_size={block!r}"
        )
    return Fp8Scheme(int(block[0]), int(block[1]))


def config_fp8_scheme(config: dict[str, Any], where: str) -> Fp8Scheme | None:
    """The scheme of a raw config.json with a `quantization_config`, else None."""
    quantization = config.get("quantization_config")
    return None if quantization is None else fp8_scheme(quantization, where)
