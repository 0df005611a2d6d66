#!/bin/bash
# Coupled guesses on and off: the EDD's adaptive chains against plain decoding at temperature 1 and at 0.8 with
# top-p 0.95 (every method emits ar's tokens). Usage: scripts/coupled_ab.sh [N_PROMPTS] [OUT]
# (defaults: 8, docs/results/coupled_ab); see generate_ab.sh.
set -euo pipefail
SETTINGS="T1:--temperature 1;T0.8p0.95:--temperature 0.8 --top-p 0.95" \
METHODS="ar:--method ar;argmax:--draft edd --no-coupled;coupled:--draft edd --coupled" \
  "$(dirname "$0")/generate_ab.sh" "${1:-8}" "${2:-docs/results/coupled_ab}"
