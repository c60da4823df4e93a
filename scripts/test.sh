#!/usr/bin/env bash
# Run the test suite (after scripts/setup.sh). Fails when no test ran (pytest exit 5).
#
# Two pytest worker processes (pytest-xdist), one test file per worker at a time (--dist loadfile:
# a file's module fixtures are built once): most tests wait on the processes they start (launchers,
# ranks, rendezvous, signals), so two files at once keep 2 cores busier than one.
# MOE_DIST_TEST_WORKERS=N: N workers; 0: every test in this one process.
set -uo pipefail
cd "$(dirname "$0")/.."
WORKERS=${MOE_DIST_TEST_WORKERS:-2}
PARALLEL=()
if [ "$WORKERS" != 0 ]; then PARALLEL=(-n "$WORKERS" --dist loadfile); fi
.venv/bin/python -m pytest "${PARALLEL[@]}" "$@"
rc=$?
if [ "$rc" = 5 ]; then echo "error: no tests were collected" >&2; exit 1; fi
exit "$rc"
