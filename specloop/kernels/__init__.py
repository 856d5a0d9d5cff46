"""Triton kernels, each beside its launcher and its torch reference (the oracle its tests use).

Kernels know nothing of requests, plans or the engine: tensors and page tables in, tensors out.
"""
