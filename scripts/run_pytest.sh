#!/usr/bin/env bash
# pytest with the given Python (scripts/test.sh, scripts/test_floor.sh); a run that collects no
# tests (pytest's exit status 5) counts as a failure.
#   bash scripts/run_pytest.sh PYTHON [pytest arguments]
set -uo pipefail
python=$1
shift
"$python" -m pytest "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: treating that as a failure" >&2
  exit 1
fi
exit "$status"
