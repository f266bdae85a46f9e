#!/usr/bin/env bash
# Install batchlayers (editable) with the given extra, into the active Python environment.
# Torch is installed only when none is importable, pinned to the CPU build that this project is tested
# with; a user who already has torch (any build, any device) keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-test}"
python -c "import torch" 2>/dev/null || python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[${extra}]"
