"""Training with frozen routed experts: LoRA adapters, the data, the SFT loop (the CPU experts'
backward and autograd function belong to their backend: experts/expert_grad.py,
experts/expert_function.py)."""
