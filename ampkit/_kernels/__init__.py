"""The numeric kernels: each fused op's eager reference beside its C and compiled kernels."""
