# Sourced by the scripts: where builds and environments live.
# The cargo target dir and pip's cache sit outside the clone, so a fresh clone
# on the same machine reuses what an earlier build compiled.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/rankscope/target}"
export PATH="$HOME/.cargo/bin:$PATH"
VENV="${RANKSCOPE_VENV:-$ROOT/.venv}"

# The interpreter for X.Y: on PATH, or from pyenv; empty when absent.
find_python() {
    local version="$1" candidate prefix
    if command -v pyenv >/dev/null 2>&1; then
        prefix="$(pyenv prefix "$(pyenv versions --bare 2>/dev/null | grep -E "^${version//./\\.}(\.[0-9]+)?$" | tail -n 1)" 2>/dev/null || true)"
        if [ -n "$prefix" ] && [ -x "$prefix/bin/python$version" ]; then
            echo "$prefix/bin/python$version"
            return
        fi
    fi
    for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version".*/bin/"python$version"; do
        if [ -x "$candidate" ]; then
            echo "$candidate"
            return
        fi
    done
    candidate="$(command -v "python$version" 2>/dev/null || true)"
    if [ -n "$candidate" ] && "$candidate" -c "import sys; assert sys.version_info[:2] == tuple(map(int, '$version'.split('.')))" 2>/dev/null; then
        echo "$candidate"
    fi
}

# Installs Debian packages when this user may (root, or passwordless sudo);
# returns non-zero when it could not.
apt_install() {
    command -v apt-get >/dev/null 2>&1 || return 1
    local sudo=""
    if [ "$(id -u)" != 0 ]; then
        sudo -n true 2>/dev/null || return 1
        sudo="sudo -n"
    fi
    echo "== installing $* (Debian packages)"
    $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1 \
        || { $sudo apt-get update -qq >/dev/null 2>&1 && $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1; }
}

# `bt --native` links libunwind. Without its development files the build
# goes on and `--native` says what to install.
ensure_native_unwinding() {
    local lib
    [ "$(uname -m)" = x86_64 ] || return 0
    for lib in libunwind.so libunwind-ptrace.so libunwind-x86_64.so liblzma.so; do
        if [ ! -e "/usr/lib/x86_64-linux-gnu/$lib" ]; then
            apt_install libunwind-dev liblzma-dev || echo "note: could not install libunwind-dev: bt --native will be off"
            return 0
        fi
    done
}

# The cargo arguments the wheel's build uses for the CLI (same features, so
# `cargo test` reuses its artifacts).
cli_cargo_args() {
    "$VENV/bin/python" -c "import sys; sys.path.insert(0, '$ROOT/build_backend'); import rankscope_build; print(' '.join(rankscope_build.cli_cargo_args()))"
}

# Builds the wheel (probe + CLI) once and installs it into $VENV.
build_and_install() {
    ensure_native_unwinding
    local base
    base="$(find_python 3.11)"
    [ -n "$base" ] || base="$(command -v python3)"
    if [ ! -x "$VENV/bin/python" ]; then
        "$base" -m venv "$VENV"
    fi
    "$VENV/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
    "$VENV/bin/python" -m pip install --quiet "maturin>=1.9,<2" "pytest>=8"
    rm -rf "$ROOT/.cache/wheels"
    "$VENV/bin/python" -m pip wheel --quiet --no-deps --wheel-dir "$ROOT/.cache/wheels" "$ROOT"
    WHEEL="$(ls "$ROOT"/.cache/wheels/rankscope-*.whl)"
    "$VENV/bin/python" -m pip install --quiet --force-reinstall --no-deps "$WHEEL"
    # The wheel's one dependency (breakpoints on 3.11), which --no-deps skipped.
    "$VENV/bin/python" -m pip install --quiet "$RUNTIME_DEPS"
}

RUNTIME_DEPS="bytecode>=0.15; python_version < '3.12'"
