"""Launch shapes of the unsorted pair kernels (`packed_moe`'s decode path): `PairConfig`, the
shipped shape per format (`PAIR_CONFIGS`, and `ONE_TOKEN_PAIR_CONFIGS` where one token's pairs
want another) and the command-line form the benchmarks take (`parse_pair_config`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PairConfig:
    """Launch shape of the two unsorted pair kernels (decode's path): programs per pair and
    loads in flight per program."""

    block_n_gate_up: int
    """Gate rows (and as many up rows) per gate/up program: 16, 32 or 64."""
    split_gate_up: int
    """Programs sharing one pair's k loop over H in gate/up, at most (the largest count that
    divides the loop's 64-k blocks); above 1 they write fp32 sums and `pair_down` applies
    the SiLU."""
    block_n_down: int
    """Output columns per down program: a power of two from 16 to 256."""
    split_down: int
    """Programs sharing one pair's k loop over the slice in down, at most (as gate/up's);
    each adds its share to the output by atomics."""
    k_unroll: int
    """64-k blocks one loop step takes, at most (the largest count that divides a share's
    blocks): 4 half-block loads each in gate/up, 2 in down, independent of each other."""
    warps_gate_up: int
    """Warps per gate/up program."""
    warps_down: int
    """Warps per down program."""
    factored: bool = False
    """int8, int4, fp8: no weight rounded to bf16; codes times inputs summed in fp32 over each
    group's halves in a loop step, the group's scale applied once per row. bf16 ignores it."""
    int4_words: bool = False
    """int4 with `factored` (other formats ignore it): load the codes as 32-bit words as they
    lie (each byte once, not once per nibble) and feed both nibbles of a byte to their two
    32-k halves in registers, the inputs loaded in the words' order (kernels/int4_words.py)."""

    def __post_init__(self) -> None:
        checks = [("block_n_gate_up", (16, 32, 64)), ("block_n_down", (16, 32, 64, 128, 256)),
                  ("split_gate_up", range(1, 17)), ("split_down", range(1, 17)),
                  ("k_unroll", range(1, 9)), ("warps_gate_up", (1, 2, 4, 8)),
                  ("warps_down", (1, 2, 4, 8))]
        check_choices("PairConfig", self, checks)
        for name, value in (("factored", self.factored), ("int4_words", self.int4_words)):
            if not isinstance(value, bool):
                raise ValueError(f"PairConfig: {name} must be True or False, got {value!r}")
        if self.int4_words and not self.factored:
            raise ValueError("PairConfig: int4_words needs factored=True (the word read sums "
                             "codes times inputs per group, never a bf16 weight)")


def check_choices(kind: str, config: object,
                  checks: Sequence[tuple[str, Sequence[int]]]) -> None:
    """ValueError naming `kind` and the field when one of `config`'s fields in `checks` (name,
    allowed values: a tuple or a range) is not allowed (the launch-shape configs: PairConfig,
    kernels/gemv_config.py's GemvConfig)."""
    for name, allowed in checks:
        value = getattr(config, name)
        if value not in allowed:
            shown = f"from {allowed[0]} to {allowed[-1]}" if isinstance(allowed, range) \
                else "one of " + ", ".join(map(str, allowed))
            raise ValueError(f"{kind}: {name} must be {shown}, got {value}")


def parse_pair_config(text: str) -> PairConfig:
    """A `PairConfig` from a command line: its fields in order, comma-separated, the 7 integers
    then optionally `factored` and `int4_words` as 0 or 1 (e.g. "16,1,128,4,4,4,8,1")."""
    names = [f.name for f in dataclasses.fields(PairConfig)]
    values = text.split(",")
    if not 7 <= len(values) <= len(names):
        raise ValueError(f"pair config {text!r}: 7 to {len(names)} comma-separated fields "
                         f"({', '.join(names)}), got {len(values)}")
    try:
        ints = [int(v) for v in values]
    except ValueError:
        raise ValueError(f"pair config {text!r}: every field is an integer (the flags 0 or "
                         f"1)") from None
    if any(v not in (0, 1) for v in ints[7:]):
        raise ValueError(f"pair config {text!r}: {', '.join(names[7:len(ints)])} must be 0 or 1")
    a, b, c, d, e, f, g = ints[:7]  # in PairConfig's field order
    return PairConfig(a, b, c, d, e, f, g, *(bool(v) for v in ints[7:]))


# Fields as PairConfig's (`bench_packed_moe.py --pair-sweep` times other shapes).
PAIR_CONFIGS = {
    "bf16": PairConfig(32, 1, 64, 1, 4, 4, 4),
    "int8": PairConfig(16, 2, 64, 3, 4, 4, 4, factored=True),
    "int4": PairConfig(16, 1, 128, 4, 4, 4, 8, factored=True),
    "fp8": PairConfig(32, 2, 32, 2, 8, 4, 2, factored=True),
}
"""Per format, round 6's best (H100, a Qwen3-30B-A3B layer, graphs; gpu_kernels.md): factored
sums win for every quantized format. T = 1 / 8 ms: int8 0.042 / 0.179 -> 0.029 / 0.142, int4
(G 32) 0.066 / 0.249 -> 0.029 / 0.148, fp8 0.065 / 0.161 -> 0.024 / 0.111; bf16 keeps round 2's."""

ONE_TOKEN_PAIR_CONFIGS = {
    "int4": PairConfig(16, 2, 128, 4, 4, 4, 8, factored=True),
}
"""Per format, the launch shape for one token's pairs (decode at batch 1) where it beats
`PAIR_CONFIGS`' as decode runs it: each layer's experts cold in L2, fp32 inputs
(`bench_pair_cold.py --formats int8,int4 --tokens 1,8 --layers 8`, H100, 2026-11-27,
docs/benchmarks/gpu_kernels.md). int4 (G 32), ms a layer at T = 1 / 8: `PAIR_CONFIGS`' shape
0.0483 / 0.1541, this one 0.0356 / 0.1760 (likely because two gate/up programs a pair fill
SMs that one token's 8 pairs leave idle, while at 8 tokens they are full; not profiled)."""


def pair_config_for(fmt: str, tokens: int) -> PairConfig:
    """The pair kernels' launch shape for `tokens` tokens of format `fmt`."""
    if tokens == 1 and fmt in ONE_TOKEN_PAIR_CONFIGS:
        return ONE_TOKEN_PAIR_CONFIGS[fmt]
    return PAIR_CONFIGS[fmt]
