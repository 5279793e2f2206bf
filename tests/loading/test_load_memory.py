"""Peak memory while loading: at most 1.3x the weights that end up resident (issue 2)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from hetmoe.presets.tiny import build_tiny_model

# Runs in a fresh interpreter; every lazy import (config, modeling, tokenizer) happens before the
# baseline. The peak is VmHWM, reset through clear_refs: ru_maxrss would carry over the parent's
# peak, which Linux keeps across fork + exec.
_MEASURE = textwrap.dedent(
    """
    import gc, json, sys
    import psutil, torch
    from transformers import AutoTokenizer
    from hetmoe.loading import Checkpoint, build_skeleton, load_model

    def high_water_mark():
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024

    path = sys.argv[1]
    build_skeleton(Checkpoint.open(path).config, torch.bfloat16)
    AutoTokenizer.from_pretrained(path)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM to the current RSS
    base = psutil.Process().memory_info().rss
    loaded = load_model(path, device="cpu", progress=False)
    peak = high_water_mark()
    state = list(loaded.model.state_dict().values()) + list(loaded.model.buffers())
    weights = sum(t.numel() * t.element_size() for t in {id(t): t for t in state}.values())
    print(json.dumps({"base": base, "peak": peak, "weights": weights}))
    """
)


def test_peak_rss_while_loading_stays_within_1_3x_of_the_weights(tmp_path):
    # Mixtral with 1024 hidden: ~56M fp32 parameters (~225 MB), experts stacked into fused params.
    path = build_tiny_model(
        "mixtral", tmp_path / "big", hidden_size=1024, intermediate_size=1024,
        num_attention_heads=8, num_key_value_heads=2,
    )
    result = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    sizes = json.loads(result.stdout.strip().splitlines()[-1])
    weights, growth = sizes["weights"], sizes["peak"] - sizes["base"]
    assert weights > 200e6
    assert growth <= 1.3 * weights, (
        f"peak RSS grew by {growth / 1e6:.0f} MB while loading {weights / 1e6:.0f} MB of weights "
        f"({growth / weights:.2f}x > 1.3x)"
    )
