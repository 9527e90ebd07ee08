"""The CPU backend (backend.py) and what it owns: the fused Llama-family forward (fused_layers.py), the compiled
C kernels (native.py, csrc/, built at install time) and the packed oneDNN linears (packed_linear.py)."""
