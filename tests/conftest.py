"""Shared fixtures: real PTX/cubins compiled once per test session."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, settings

# GPU property tests: the example count comes from the environment so a device run can be sized
# to its time limit; on the device, shrinking is off (each shrink step is a GPU run) and the
# first failing example is reported as drawn.
settings.register_profile(
    "gpu",
    max_examples=int(os.environ.get("FLASHCORE_GPU_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    phases=[Phase.explicit, Phase.reuse, Phase.generate]
    + ([] if os.environ.get("FLASHCORE_NO_SHRINK") else [Phase.shrink]),
    print_blob=True,
)

from tests.kernels import (
    CompiledKernel,
    assemble,
    compile_tiny_dsl_kernel,
    handwritten_ptx,
    have_dsl,
    have_ptxas,
)


@pytest.fixture(scope="session")
def dsl_kernel(tmp_path_factory: pytest.TempPathFactory) -> CompiledKernel:
    """The tiny CuTe DSL kernel (two 48-byte tensor structs and an f32), built for sm_90."""
    if not have_dsl():
        pytest.skip("nvidia-cutlass-dsl is not installed")
    return compile_tiny_dsl_kernel(tmp_path_factory.mktemp("dsl"))


@pytest.fixture(scope="session")
def spilly_kernel(tmp_path_factory: pytest.TempPathFactory) -> tuple[CompiledKernel, str]:
    """Hand-written PTX with spills, a stack frame and static shared memory; and ptxas's report."""
    if not have_ptxas():
        pytest.skip("ptxas is not on PATH")
    ptx = handwritten_ptx()
    cubin, report = assemble(ptx, tmp_path_factory.mktemp("spilly"))
    return CompiledKernel(ptx, cubin), report
