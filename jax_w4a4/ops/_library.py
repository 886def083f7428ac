"""Finding, loading and registering ``libjax_w4a4.so``, the CUDA kernels and their XLA FFI handlers.

The library is Python-independent (plain C ABI), loaded with ctypes and registered with
``jax.ffi.register_ffi_target`` the first time a primitive is lowered for CUDA.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import jax

LIBRARY_NAME = "libjax_w4a4.so"
ENV_LIBRARY = "JAX_W4A4_LIBRARY"

# The ops that have a CUDA kernel in this version: op name -> exported handler symbol. The FFI target
# is "jax_w4a4_<op>". An op missing here fails its CUDA lowering with NotImplementedError.
CUDA_KERNELS: dict[str, str] = {
    "act_quant": "JaxW4a4ActQuant",
    "w4a4_gemm": "JaxW4a4W4a4Gemm",
    "w4a4_linear": "JaxW4a4W4a4Linear",
    "w4a16_gemm": "JaxW4a4W4a16Gemm",
}


# FFI targets that are not ops, for the benchmarks: the device clock they time chains of kernels with
# (benchmarks/harness.py) and the stream peer, a plain kernel moving act_quant's bytes
# (benchmarks/bench_act_quant.py). Target name -> exported handler symbol.
TOOL_TARGETS: dict[str, str] = {
    "jax_w4a4_device_clock": "JaxW4a4DeviceClock",
    "jax_w4a4_stream_peer": "JaxW4a4StreamPeer",
}


def target_name(op: str) -> str:
    return f"jax_w4a4_{op}"


def find_shared_library(name: str) -> Path | None:
    """A library built by CMake: next to the package (installed), else anywhere under the repo's build/."""
    package_dir = Path(__file__).resolve().parent.parent
    candidates = [package_dir / name]
    repo_build = package_dir.parent / "build"
    if repo_build.is_dir():
        candidates += sorted(repo_build.glob(f"**/{name}"))
    return next((p for p in candidates if p.is_file()), None)


def library_path() -> Path | None:
    """Where the CUDA library is: ``$JAX_W4A4_LIBRARY``, else next to the package, else ``build/``."""
    forced = os.environ.get(ENV_LIBRARY)
    if forced:
        path = Path(forced)
        if not path.is_file():
            raise FileNotFoundError(f"{ENV_LIBRARY}={forced} does not name a file")
        return path
    return find_shared_library(LIBRARY_NAME)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The loaded library, or None when it was not built (no nvcc at install time)."""
    path = library_path()
    return None if path is None else ctypes.cdll.LoadLibrary(str(path))


def compiled_targets() -> list[str]:
    """FFI target names compiled into the library (empty when there is no library)."""
    lib = load()
    if lib is None:
        return []
    lib.JaxW4a4Targets.restype = ctypes.c_char_p
    return [name for name in lib.JaxW4a4Targets().decode().split(",") if name]


def armed_arrival_counters() -> int:
    """How many of the kernels' cross-CTA arrival counters on the current CUDA device are not zero (every
    launch must leave them at 0: csrc/common/arrival_counters.h); -1 when they cannot be read. Waits for
    the device; a test hook."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"{LIBRARY_NAME} is not built")
    lib.JaxW4a4ArmedArrivalCounters.restype = ctypes.c_int64
    return int(lib.JaxW4a4ArmedArrivalCounters())


DEFAULT_SM_COUNT = 132  # H100 SXM, H200


@functools.cache
def cuda_sm_count() -> int:
    """SMs of the first CUDA device, for which the kernels' launches are planned at lowering time; 132
    (H100 SXM / H200) when there is none (e.g. ``jax.export`` on a CPU host). Another count only changes
    how the work is split, never the result."""
    if not _cuda_backend_present():
        return DEFAULT_SM_COUNT
    return int(getattr(jax.devices("cuda")[0], "core_count", 0) or DEFAULT_SM_COUNT)


def _cuda_backend_present() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


@functools.cache
def register_cuda_targets() -> tuple[str, ...]:
    """Registers the CUDA kernels compiled into the library with XLA; returns their op names.

    Runs at import, so that deserialized ``jax.export`` modules find their targets too. Registering
    for CUDA is harmless on a machine without a GPU.
    """
    compiled = set(compiled_targets())
    registered = tuple(op for op in CUDA_KERNELS if target_name(op) in compiled)
    for op in registered:
        _register(target_name(op), CUDA_KERNELS[op])
    return registered


@functools.cache
def register_tool_target(target: str) -> bool:
    """Registers one of :data:`TOOL_TARGETS` with XLA when a GPU is present and the library has it;
    returns whether it is usable."""
    if not _cuda_backend_present() or target not in compiled_targets():
        return False
    _register(target, TOOL_TARGETS[target])
    return True


def _register(target: str, symbol: str) -> None:
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(load(), symbol)), platform="CUDA")


def require_cuda_target(op: str) -> None:
    """Lowering-time check that a CUDA kernel exists for ``op`` and, on a GPU host, that it is loaded.

    Lowering for CUDA on a host without the library (``jax.export`` on a CPU machine) is allowed.
    """
    if op not in CUDA_KERNELS:
        raise NotImplementedError(
            f"jax_w4a4.{op}: no CUDA kernel in this version of jax_w4a4; "
            "run it on CPU (the reference path) or use an op that has one"
        )
    if op in register_cuda_targets() or not _cuda_backend_present():
        return
    if load() is None:
        raise RuntimeError(
            f"jax_w4a4.{op}: a CUDA device is present but {LIBRARY_NAME} was not found. Install the "
            f"package on a machine with nvcc (CUDA 13) so CMake builds it, or point {ENV_LIBRARY} at a build."
        )
    raise RuntimeError(f"jax_w4a4.{op}: {library_path()} lacks the FFI target {target_name(op)}; rebuild it")
