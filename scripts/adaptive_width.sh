#!/bin/bash
# The EDD's adaptive draft with and without runner-up fans against plain decoding, greedy and at temperature 1.
# Usage: scripts/adaptive_width.sh [N_PROMPTS] [OUT] (defaults: 8, docs/results/adaptive_width); see generate_ab.sh.
set -euo pipefail
SETTINGS="T0:--temperature 0;T1:--temperature 1" \
METHODS="ar:--method ar;width1:--draft edd --draft-width 1;width4:--draft edd --draft-width 4" \
  "$(dirname "$0")/generate_ab.sh" "${1:-8}" "${2:-docs/results/adaptive_width}"
