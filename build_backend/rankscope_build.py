"""PEP 517 backend: maturin, after building the `rankscope` CLI binary.

maturin packs one Rust artifact per wheel: here the probe (`rankscope._native`).
The CLI is a separate binary, so that targets never load its SQL engine. This
wrapper builds it with cargo and drops it into `wheel-data/scripts/`, which
maturin ships as the wheel's scripts; pip installs it on PATH as `rankscope`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import maturin
from maturin import (  # noqa: F401 - re-exported hooks
    build_sdist,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_wheel,
)

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "wheel-data" / "scripts"


def _target_dir() -> Path:
    configured = os.environ.get("CARGO_TARGET_DIR")
    return Path(configured) if configured else ROOT / "target"


# What py-spy's native unwinder links against (Debian: libunwind-dev, liblzma-dev).
NATIVE_LIBS = ("libunwind.so", "libunwind-ptrace.so", "libunwind-x86_64.so", "liblzma.so")
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def native_unwinding_available() -> bool:
    """`bt --native` needs libunwind at build time; without it the CLI is
    built without native frames (and says so when asked). RANKSCOPE_NATIVE=0
    or 1 overrides the check."""
    forced = os.environ.get("RANKSCOPE_NATIVE")
    if forced in ("0", "1"):
        return forced == "1"
    return all(any(Path(d, lib).exists() for d in LIB_DIRS) for lib in NATIVE_LIBS)


def cli_cargo_args() -> list[str]:
    args = ["--release", "--locked", "-p", "rankscope-cli"]
    if native_unwinding_available():
        args += ["--features", "rankscope-cli/native"]
    return args


def _build_cli() -> None:
    if os.environ.get("RANKSCOPE_SKIP_CLI_BUILD") and (SCRIPTS / "rankscope").exists():
        return
    cargo = shutil.which("cargo") or str(Path.home() / ".cargo" / "bin" / "cargo")
    subprocess.run(
        [cargo, "build", *cli_cargo_args(), "--bin", "rankscope"],
        cwd=ROOT,
        check=True,
    )
    SCRIPTS.mkdir(parents=True, exist_ok=True)
    shutil.copy2(_target_dir() / "release" / "rankscope", SCRIPTS / "rankscope")


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _build_cli()
    return maturin.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _build_cli()
    return maturin.build_editable(wheel_directory, config_settings, metadata_directory)
