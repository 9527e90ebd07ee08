"""The CPU backend (backend.py) and what it owns: the fused Llama-family forward (fused_layers.py), the compiled
C kernels (native.py, csrc/, built at install time), the packed oneDNN linears (packed_linear.py) and the float32
linears as three bfloat16 products on AMX tiles that encoders use (split_linear.py)."""
