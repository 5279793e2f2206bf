"""Modules that injection puts in place of HF ones: hybrid MoE, static-KV attention."""
