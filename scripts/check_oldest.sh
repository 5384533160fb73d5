#!/usr/bin/env bash
# Run the quick test subset at the oldest versions pyproject.toml admits (not part of CI: it builds a second
# virtual environment, .venv-oldest, and takes a few minutes).
#
#   bash scripts/check_oldest.sh                 # every lower bound from pyproject.toml
#   OLDEST="transformers==4.56.0" bash ...       # try other pins (space-separated, override the bounds)
#
# torch: this machine holds one CPU build (2.13.0); any older torch is a multi-GB CUDA download, so the torch
# bound is checked only where TORCH= names a build that can be installed (TORCH=2.7.0 on a machine with the
# CPU wheel index).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-oldest}
TORCH=${TORCH:-2.13.0}
QUICK=(tests/config tests/test_train_app.py tests/test_data.py tests/test_sweep.py tests/test_options.py
       tests/test_compat.py tests/test_strategy.py tests/test_plan.py tests/test_policies.py tests/test_precision.py
       tests/test_lora.py tests/quantization tests/memory/test_estimate.py tests/test_strategy_distributed.py
       tests/test_imports.py)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
pins=$(python3 - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
for dep in deps:
    name, low = re.match(r"([A-Za-z0-9_.-]+)\s*>=\s*([^,;\s]+)", dep).groups()
    if name != "torch":
        print(f"{name}=={low}")
PY
)
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==$TORCH"
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install -q $pins ${OLDEST:-} "hydra-core==1.3.2" "datasets==2.19.0" "matplotlib==3.9.0" \
    "torchdata==0.11.0" "tensorboard==2.18.0" "wandb==0.17.2" \
    "pytest>=8,<9" "pytest-xdist>=3.5" "torch==$TORCH"
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" -m pip list 2>/dev/null | grep -iE "^(torch|lightning|transformers|peft|bitsandbytes|safetensors) "
exec "$VENV/bin/python" -m pytest -q -x "${QUICK[@]}" "$@"
