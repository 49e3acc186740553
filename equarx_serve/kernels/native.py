"""Native XLA:CPU kernels: C++ sources built on first use and registered as FFI targets.

    KERNEL = NativeKernel(Path(__file__).with_suffix(".cc"), "EquarxHeadGemv", "equarx_head_gemv")
    if KERNEL.available():  # built (or found) and registered, once a process
        y = jax.ffi.ffi_call(KERNEL.target, out_shape)(x, ...)

A kernel's source is compiled with the system's C++ compiler (`$CXX`, else `c++` or `g++`;
`-O3 -march=native` plus its own flags, ~4 s) into `$EQUARX_SERVE_CACHE/kernels` (default
`~/.cache/equarx-serve/kernels`), keyed by the source, the headers beside it (`bf16.h`), the
flags, the jaxlib version and the CPU's features, and loaded with ctypes. Callers fall back to
their XLA formulation where `available()` is False: no compiler, a failed build (a warning,
once a kernel and process), or `EQUARX_SERVE_NATIVE_KERNELS=0`; and on TPU/GPU through
`lax.platform_dependent`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

from equarx_serve.cache_root import default_cache_root

logger = logging.getLogger("equarx_serve.kernels")

FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
DISABLE_ENV = "EQUARX_SERVE_NATIVE_KERNELS"


def target_platform() -> str:
    """The platform of the devices the program now being traced is for: the mesh's inside
    `shard_map` (or under `jax.sharding.use_abstract_mesh`), else JAX's default backend.

    Choices that shape a program (whether it calls the native kernels at all, how it cuts a
    message for them) follow this, not the host: traced here for an abstract TPU or GPU mesh, a
    program takes that platform's path. Choices between kernels of the same shape go through
    `lax.platform_dependent` instead, so that one program lowers for every platform."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    return jax.default_backend() if device is None else device.platform


@dataclasses.dataclass(frozen=True)
class NativeKernel:
    """One C++ source exporting one XLA FFI handler `symbol`, registered as `target` on CPU;
    `fallback` names what callers run without it (for the warning)."""

    source: Path
    symbol: str
    target: str
    fallback: str
    extra_flags: tuple[str, ...] = ()

    @property
    def flags(self) -> tuple[str, ...]:
        return (*FLAGS, *self.extra_flags)

    def build(self) -> Path:
        """The shared library, compiled unless the cache holds it (atomic: concurrent processes
        each write their own file and rename it into place)."""
        compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        if compiler is None:
            raise RuntimeError("no C++ compiler (c++, g++ or $CXX) on the PATH")
        headers = sorted(self.source.parent.glob("*.h"))  # the sources' shared headers
        parts = [
            self.source.read_bytes(),
            *(header.read_bytes() for header in headers),
            " ".join(self.flags).encode(),
            jaxlib.__version__.encode(),
        ]
        key = hashlib.sha256(b"\0".join([*parts, _cpu_signature()])).hexdigest()[:16]
        library = default_cache_root() / "kernels" / f"{self.source.stem}-{key}.so"
        if library.exists():
            return library
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
            built = Path(tmp) / library.name
            includes = [f"-I{jax.ffi.include_dir()}", f"-I{self.source.parent}"]
            command = [compiler, *self.flags, *includes, str(self.source), "-o", str(built)]
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
            os.replace(built, library)
        return library

    def available(self) -> bool:
        """Whether the kernel is registered (building it on the first call), unless
        `EQUARX_SERVE_NATIVE_KERNELS=0`."""
        return os.environ.get(DISABLE_ENV, "1") != "0" and register(self)


@functools.cache
def register(kernel: NativeKernel) -> bool:
    """Builds (or finds) and registers `kernel`, once a process; False if that fails."""
    try:
        library = ctypes.cdll.LoadLibrary(str(kernel.build()))
        handler = jax.ffi.pycapsule(getattr(library, kernel.symbol))
        jax.ffi.register_ffi_target(kernel.target, handler, platform="cpu")
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        logger.warning("the native %s is unavailable, using %s: %s", kernel.target,
                       kernel.fallback, e)  # fmt: skip
        return False
    return True


def _cpu_signature() -> bytes:
    """What -march=native compiled for: the CPU's feature flags (a cache shared by machines
    with other CPUs must not hand them this one's library)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor().encode()
    flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    return flags.encode()
