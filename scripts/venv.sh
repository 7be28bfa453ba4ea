#!/usr/bin/env bash
# Create .venv with a Python >= 3.12 interpreter and install pymc_sgmcmc with its test tools.
# Idempotent: re-running only reinstalls when pyproject.toml changed. PyMC 6 needs Python >= 3.12;
# on machines whose `python3` is older, the interpreter is looked up on PATH and in pyenv.
set -euo pipefail
cd "$(dirname "$0")/.."

is_312() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }

find_python() {
    local candidates=("${PYTHON:-}" python3.14 python3.13 python3.12 python3)
    local root
    root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
    candidates+=("$root"/versions/3.1[2-9]*/bin/python3)
    for c in "${candidates[@]}"; do
        [ -n "$c" ] || continue
        if command -v "$c" >/dev/null 2>&1 && is_312 "$c"; then
            command -v "$c"
            return 0
        fi
    done
    echo "error: Python >= 3.12 not found (PyMC 6 needs it); set PYTHON=/path/to/python3.12" >&2
    return 1
}

if [ ! -x .venv/bin/python ] || ! is_312 .venv/bin/python; then
    rm -rf .venv
    "$(find_python)" -m venv .venv
fi
# EXTRAS: the optional-dependency groups to install (default "test"; `make docs` uses
# "test,docs"). Each set of extras has its own stamp, so switching targets does not reinstall.
extras=${EXTRAS:-test}
hash=$(sha1sum pyproject.toml | cut -c1-12)
stamp=.venv/.installed-$hash
[ "$extras" = test ] || stamp="$stamp-${extras//,/-}"
if [ ! -f "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".[$extras]"
    # Stamps of an older pyproject.toml are stale; those of other extras stay valid.
    find .venv -maxdepth 1 -name '.installed-*' ! -name ".installed-$hash*" -delete
    touch "$stamp"
fi
