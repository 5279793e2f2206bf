"""Training with frozen routed experts: the CPU experts' backward and autograd function, LoRA
adapters, the SFT loop."""
