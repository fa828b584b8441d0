"""Where and how ``dpcore.native``'s library is built, and why it can be trusted.

The C files in ``dpcore/csrc`` are compiled on first use with the system's C compiler
(``$CC``, else ``cc``), for this CPU (``-march=native``), into a per-user cache directory
(``$DP_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/dp-platform/native``, else
``~/.cache/dp-platform/native``), keyed by the source, the flags, the compiler's version and
the CPU. The cache directory must belong to this user and not be writable by others, nor may
any directory above it be (unless sticky, like /tmp): a shared library is loaded from it.
Otherwise a private temporary directory is used, and removed at exit.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

_SOURCES = [Path(__file__).with_name("csrc") / name for name in ("conv_pe.c", "wsum.c", "rowstats.c")]
_HEADERS = [Path(__file__).with_name("csrc") / "threads.h"]  # in the cache key, not compiled alone
_BASE_FLAGS = ["-O3", "-std=gnu11", "-shared", "-fPIC", "-pthread"]
# Tried in order; the first that compiles is used.
_ARCH_FLAGS = (
    ["-fopenmp", "-march=native", "-mprefer-vector-width=512"],
    ["-fopenmp", "-march=native"],
    ["-march=native"],
    [],
)


def cpu_id() -> str:
    """The machine and the first CPU's model and feature flags, for the cache key: a kernel
    built with ``-march=native`` is only loaded on the CPU it was built for. (Not the whole
    cpuinfo block: its clock speed moves with frequency scaling.)"""
    keep = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU variant", "CPU part")
    lines = []
    try:
        for line in Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0].splitlines():
            if line.split(":", 1)[0].strip() in keep:
                lines.append(line)
    except OSError:
        pass
    return "\n".join([platform.machine(), platform.processor(), *lines])


def private_dir(path: Path) -> bool:
    """True if ``path`` is a directory of this user that no one else can write to, and no
    directory above it can be changed by anyone but this user or root (a group- or
    world-writable ancestor must be sticky, like /tmp, so that no one else can rename what is
    in it). A shared library is loaded from here: nobody else may plant or swap one."""
    try:
        real = path.resolve(strict=True)
        st = real.stat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return False
        for parent in real.parents:
            st = parent.stat()
            if st.st_uid not in (os.getuid(), 0):
                return False
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
                return False
    except OSError:
        return False
    return True


def user_cache() -> Path:
    """The platform's per-user cache: ``$XDG_CACHE_HOME/dp-platform``, else ``~/.cache/dp-platform``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dp-platform"


def private_cache(name: str) -> Path | None:
    """``user_cache()/name``, made if missing (mode 700), if it is :func:`private_dir`; else None."""
    path = user_cache() / name
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        return None
    return path if private_dir(path) else None


def cache_dir() -> Path:
    env = os.environ.get("DP_NATIVE_CACHE")
    path = Path(env) if env else user_cache() / "native"
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        pass
    if private_dir(path):
        return path
    private = Path(tempfile.mkdtemp(prefix="dp-native-"))  # mode 700; removed at exit
    atexit.register(shutil.rmtree, private, True)
    return private


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def builds(cc: str, out_dir: Path):
    """Yield a built library for each flag set in turn (cached ones are reused), so that the
    caller can fall through to the next one if loading or the self-check fails. Raises
    RuntimeError, with the compiler's messages, when none builds."""
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"cannot run the C compiler {cc!r}: {e}") from None
    source = b"\0".join(path.read_bytes() for path in _SOURCES + _HEADERS)
    errors = []
    yielded = False
    for arch in _ARCH_FLAGS:
        flags = _BASE_FLAGS + arch
        key = hashlib.sha256(
            b"\0".join([source, " ".join(flags).encode(), version.encode(), cpu_id().encode()])
        ).hexdigest()[:20]
        target = out_dir / f"dpcore-{key}.so"
        if target.exists():
            yielded = True
            yield target, arch
            continue
        fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=out_dir)
        os.close(fd)
        built = False
        try:
            proc = subprocess.run(
                [cc, *flags, "-o", tmp, *map(str, _SOURCES)], capture_output=True, text=True, timeout=120
            )
            if proc.returncode == 0:
                os.replace(tmp, target)  # atomic: concurrent builders (Ray workers) are safe
                built = True
            else:
                errors.append(
                    f"{' '.join(arch) or 'no -march'}: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}"
                )
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(f"{' '.join(arch)}: {e}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        if built:
            yielded = True
            yield target, arch
    if not yielded:
        raise RuntimeError("the C compiler failed: " + "; ".join(map(str, errors)))
