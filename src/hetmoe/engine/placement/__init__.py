"""Which routed experts the GPU computes: resident experts, layer streaming, split/fetch plans."""
