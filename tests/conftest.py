"""Shared fixtures: small random checkpoints written in the real Hugging Face layout, and a
small default KV pool for CPU engines."""

from __future__ import annotations

import dataclasses
import os
import platform
from collections.abc import Iterator
from pathlib import Path

# The bit-exact record (tests/golden/bit_exact.json) was taken with PyTorch's AVX2 CPU
# kernels. On a CPU with AVX-512 PyTorch picks other kernels whose sums round differently,
# so every cell's logprobs came out a few fp32 ulps from the record (up to 9e-7 relative,
# tokens equal) and the record could not be checked bit for bit. Pinning the record's
# capability (before torch is imported, which is when it is read) makes it reproducible on
# any x86 CPU with AVX2; set ATEN_CPU_CAPABILITY to override.
if platform.machine().lower() in ("x86_64", "amd64"):
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")

import pytest  # noqa: E402
import torch  # noqa: E402

# Kernel tests run everywhere: without CUDA, Triton's interpreter runs them on CPU tensors
# (set before any kernel module is imported, which is when Triton reads it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests run tiny matrices: one intra-op thread (also for the servers tests start) avoids the
# thread pool's wake-ups, which cost more than the arithmetic (a [4, 64] x [64, 384] linear:
# 6 us with one thread, 400 us with two on a 2-core machine).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from specloop.checkpoint import load_model  # noqa: E402
from specloop.checkpoint.random_checkpoint import PRESETS, write_random_checkpoint
from specloop.config import ModelConfig

# The `slow` marker (pyproject) leaves these out of the README's smoke subset, `-m "not slow"`:
# modules and single tests that take seconds each, chosen from `--durations` on the 2-core CI
# machine (seconds of the module or test, run alone). A node id starts with one of them.
SLOW = (
    "tests/chaos/",  # 183: hundreds of requests through AsyncEngine, HTTP and snapshots
    "tests/test_kernels_sparse_decode.py",  # 147: the Triton interpreter
    "tests/test_kv_residual_engine.py",  # 137
    "tests/test_kernels_packed_attention.py",  # 104: the interpreter
    "tests/test_sparse_decode_engine.py",  # 97
    "tests/test_speculation.py",  # 73
    "tests/test_attention_backends.py",  # 61: the interpreter end to end
    "tests/test_flash_prefill.py::test_engine_with_the_path_equals_the_paged_kernel",  # 40: the interpreter
    "tests/test_bit_exact.py",  # 35
    "tests/test_kernels_residual_encode.py",  # 33
    "tests/test_kernels_paged_attention.py",  # 25
    "tests/test_server_hostile.py",  # 25: a real server
    "tests/test_cuda_graphs.py",  # 22 (CPU: the interpreter cases)
    "tests/test_flashloop_matrix.py",  # 22
    "tests/test_server_speculation.py",  # 22: real servers
    "tests/test_server_preemption.py",  # 19
    "tests/test_server_lifecycle.py",  # 17
    "tests/test_security.py",  # 17
    "tests/test_kernels_rope.py",  # 17
    "tests/test_server_sparse_prefill.py",  # 13
    "tests/test_speculation_chaos.py",  # 10
    "tests/test_server_queue.py",  # 8
    "tests/test_fault_injection.py::test_server_with_a_forward_fault_fails_every_request_and_exits_1",  # 9
    "tests/test_data_parallel.py::test_serve_with_two_replicas_survives_a_failed_replica",  # 14: a real server
    "tests/test_data_parallel_failures.py",  # 25: replica processes
    "tests/test_cli.py::test_engine_death_stops_the_server_with_exit_1",  # 8
    "tests/test_cli.py::test_api_key_and_positional_model",  # 6
    "tests/test_prompt_bound.py::test_no_token_covers_more_than_the_longest[shipped]",  # 7
    "tests/test_token_sparse_prefill.py::test_triton_backend_under_the_interpreter",  # 4
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)


TINY = PRESETS["tiny"]  # GQA: 4 query heads over 2 KV heads
TINY_MHA = dataclasses.replace(TINY, num_key_value_heads=4, num_hidden_layers=3, hidden_size=48,
                               head_dim=12, vocab_size=300)
# Default KV budget of a CPU engine in tests (the engine's own is 256 MiB, about 0.1 s to
# allocate and zero per engine). 32 MiB holds the largest request a test makes today (203
# tokens of the shipped model in fp64: 52 pages of 384 KiB) with room to spare; a test
# that needs more passes kv_cache_bytes or num_kv_pages itself.
TEST_CPU_KV_BYTES = 32 << 20
CPU_KV_ENV = "SPECLOOP_CPU_KV_BYTES"


@pytest.fixture(scope="session", autouse=True)
def small_cpu_kv_budget() -> Iterator[int]:
    """Give CPU engines a small default KV pool, which they allocate and zero up front
    (`specloop.engine.core` reads the variable per engine, so it also reaches the server
    processes tests start); one already set (to run the suite at another size) is kept."""
    with pytest.MonkeyPatch.context() as mp:
        if CPU_KV_ENV not in os.environ:
            mp.setenv(CPU_KV_ENV, str(TEST_CPU_KV_BYTES))
        budget = int(os.environ[CPU_KV_ENV])
        yield budget


def make_checkpoint(root: Path, cfg: ModelConfig, seed: int = 0, dtype=torch.float32, **kw) -> Path:
    return write_random_checkpoint(root, cfg, seed=seed, dtype=dtype, **kw)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), TINY, seed=1)


@pytest.fixture(scope="session")
def tiny_mha_ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny_mha"), TINY_MHA, seed=2)


@pytest.fixture(params=["gqa", "mha"])
def any_ckpt(request, tiny_ckpt, tiny_mha_ckpt) -> Path:
    return tiny_ckpt if request.param == "gqa" else tiny_mha_ckpt


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


@pytest.fixture(scope="session")
def tiny_model_fp32(tiny_ckpt):
    model, _ = load_model(tiny_ckpt, dtype=torch.float32)
    return model
