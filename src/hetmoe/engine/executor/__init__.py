"""The device executor: the model runner, CUDA graphs, fused decode, CPU/GPU overlap, KV slots."""
