"""Triton GPU kernels (paged KV-cache store and attention)."""
