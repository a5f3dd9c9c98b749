"""Kernels behind the model's attention and MoE layers: a torch reference (CPU, test oracle) and GPU fast paths."""
