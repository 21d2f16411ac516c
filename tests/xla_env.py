"""The suite's XLA settings, in one place.

:data:`SUITE_XLA_FLAGS` are set for the whole suite by ``conftest.py`` (before anything imports
JAX; every ``hetrl`` subprocess a test starts inherits them): XLA's CPU backend compiles at its
lowest LLVM optimization level. The suite compiles over a thousand distinct programs (tiny models
at many shapes and numerics) and runs each for a few steps, so on a clean clone compiling is most
of a tiny run's extra cost over a warm one; at this level a cold tiny run compiles in about a
third less time and a warm one runs as fast (BENCHMARKS.md, "Test-suite compile time"). The level
changes how fast the kernels run, not what they compute: no fast-math and no reassociation, and
the bit-for-bit tests (activation formats jitted against ml_dtypes casting, resumes, replays)
hold under it. The older loop emitters (``--xla_cpu_use_fusion_emitters=false``) would compile
faster still but round NVFP4 / MXFP4 scale divisions differently in a few elements, which
``tests/test_activation_precision.py`` catches: they are not used. Users' runs keep XLA's defaults.

:func:`host_devices` is the environment of a JAX process with ``n`` fake CPU devices, keeping the
suite's flags.
"""

from __future__ import annotations

import os

SUITE_XLA_FLAGS = ("--xla_backend_optimization_level=0",)


def apply_suite_flags() -> None:
    """Prepend :data:`SUITE_XLA_FLAGS` to ``XLA_FLAGS`` (flags the caller already set come later and win)."""
    current = os.environ.get("XLA_FLAGS", "")
    if not all(flag in current for flag in SUITE_XLA_FLAGS):
        os.environ["XLA_FLAGS"] = " ".join([*SUITE_XLA_FLAGS, current]).strip()


def host_devices(n: int) -> dict[str, str]:
    """``XLA_FLAGS`` / ``JAX_PLATFORMS`` for a JAX process on ``n`` fake CPU devices (merge into an environment)."""
    flags = os.environ.get("XLA_FLAGS", "")
    return {"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={n}".strip(), "JAX_PLATFORMS": "cpu"}
