"""Triton kernels, each beside its launcher and its torch reference (the oracle its tests use).

Kernels know nothing of requests, plans or the engine: tensors and page tables in, tensors out.
"""

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what every kernel here takes
