#!/usr/bin/env bash
# Run the test suite (after scripts/setup.sh). Fails when no test ran (pytest exit 5).
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" = 5 ]; then echo "error: no tests were collected" >&2; exit 1; fi
exit "$rc"
