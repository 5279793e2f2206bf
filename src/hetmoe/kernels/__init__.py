"""Triton GPU kernels over the CPU backend's packed expert layout (one kernel per file).

Nothing here is imported by `import hetmoe`: Triton is loaded only when a kernel is first used
(`packed_moe.packed_moe`), so CPU-only installs never need it.
"""
