#!/usr/bin/env bash
# Create (or reuse) the project venv .venv and install scalerl-zoo into it, editable.
# torch is pinned to 2.13.0: on CPU machines that is the local CPU wheel; any other spec
# pulls gigabytes of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
# The code sandbox's system packages (components/tasks/README.md, "The sandbox"): bubblewrap,
# its backend for users who are not root, and libseccomp, its system call filter. Installed
# here when we are root and they are missing (quiet, idempotent); otherwise only a note.
sandbox_missing=""
command -v bwrap >/dev/null 2>&1 || [ -x /usr/bin/bwrap ] || sandbox_missing="bubblewrap"
case "$(ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true)" in
  *libseccomp.so.2*) ;;
  *) sandbox_missing="$sandbox_missing libseccomp2" ;;
esac
if [ -n "$sandbox_missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing the sandbox's system packages:$sandbox_missing"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $sandbox_missing; } >/dev/null
  else
    echo "[setup] note: the code sandbox needs the system packages$sandbox_missing (not installed here)"
  fi
fi
VENV=${SCALERL_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
stamp="$VENV/.scalerl-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[setup] installing torch==2.13.0 and scalerl-zoo[test,bench,track] into $VENV"
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" -e ".[test,bench,track]"
  touch "$stamp"
fi
