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


def _build_cli() -> None:
    if os.environ.get("RANKSCOPE_SKIP_CLI_BUILD") and (SCRIPTS / "rankscope").exists():
        return
    cargo = shutil.which("cargo") or str(Path.home() / ".cargo" / "bin" / "cargo")
    subprocess.run(
        [cargo, "build", "--release", "--locked", "-p", "rankscope-cli", "--bin", "rankscope"],
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
