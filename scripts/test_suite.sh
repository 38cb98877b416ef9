#!/usr/bin/env bash
# `make test`: the whole suite, arranged so that two cores are busy without disturbing what the
# timing tests measure (tests/timing_files.txt says which files measure what):
#
# 1. the speed files, one test at a time, with nothing else running: they measure compute speed, and
#    any neighbour (even at low priority, on a hyperthread of the same core) changes it;
# 2. then three lanes at the same time:
#    * the timeout files, one test at a time, printed as they run, at nice -5 where permitted (root,
#      as in CI), else at normal priority: they mostly wait (heartbeat timeouts, sleeps inside steps,
#      a torchrun agent's start-up), and what they measure is whole seconds;
#    * the machines files (jobs across namespace machines, tests/machines), also one test at a time at
#      the same priority, printed after: each mostly waits for its processes' start-up and timeouts,
#      so beside the timeout files rather than after them;
#    * the bulk (every other file), TEST_WORKERS at a time (pytest-xdist) at a lower CPU priority
#      (`nice -n 5`, inherited by every process a test starts): it fills the cores the timeout lane
#      leaves idle; printed once the timeout lane is done. Not the lowest priority: at nice 19, while
#      a torchrun test's nine processes start up, a bulk job's live rank got no CPU for longer than
#      its regroup's join timeout and was evicted; at nice 5 it keeps about a tenth of a busy core.
#
# Every part always runs to the end; any one failing fails the target. Extra arguments go to every
# pytest run (e.g. `scripts/test_suite.sh -x`); PYTEST_ADDOPTS works too.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
WORKERS=${TEST_WORKERS:-2}
export OMP_NUM_THREADS=1

speed=() timeout=() machines=() ignores=()
while read -r kind path; do
    case "$kind" in
        ""|\#*) continue ;;
        speed) speed+=("$path") ;;
        timeout) timeout+=("$path") ;;
        machines) machines+=("$path") ;;
        *) echo "tests/timing_files.txt: '$kind $path': the first word must be speed, timeout or machines" >&2; exit 2 ;;
    esac
    ignores+=("--ignore=$path")
done < tests/timing_files.txt

raised=()
if nice -n -5 true 2>/dev/null; then
    raised=(nice -n -5)
fi

echo "[test] 1/2: ${#speed[@]} speed files, one test at a time, nothing else running"
"${raised[@]}" "$PY" -m pytest -p no:xdist "${speed[@]}" "$@"
speed_status=$?

bulk_log=$(mktemp -t resihp-bulk-lane-XXXXXX.log)
nice -n 5 "$PY" -m pytest -n "$WORKERS" "${ignores[@]}" "$@" >"$bulk_log" 2>&1 &
bulk=$!
machines_log=$(mktemp -t resihp-machines-lane-XXXXXX.log)
if [ "${#machines[@]}" -gt 0 ]; then
    "${raised[@]}" "$PY" -m pytest -p no:xdist "${machines[@]}" "$@" >"$machines_log" 2>&1 &
else
    true &  # no machines files listed: pytest with no path would run the whole suite again
fi
machines_lane=$!
trap 'kill "$bulk" "$machines_lane" 2>/dev/null; exit 130' INT TERM

echo "[test] 2/2: ${#timeout[@]} timeout files one test at a time${raised:+ at nice -5}, beside ${#machines[@]}" \
     "machines files (the same, printed after) and the rest of the suite ($WORKERS at a time at nice 5, printed after)"
"${raised[@]}" "$PY" -m pytest -p no:xdist "${timeout[@]}" "$@"
timeout_status=$?

echo "[test] timeout files done (status $timeout_status); waiting for the machines files and the rest of the suite"
wait "$machines_lane"
machines_status=$?
echo "================================ machines files ================================"
cat "$machines_log"
rm -f "$machines_log"
wait "$bulk"
bulk_status=$?
echo "============================ the rest of the suite ============================"
cat "$bulk_log"
rm -f "$bulk_log"
echo "[test] status: speed files $speed_status, timeout files $timeout_status, machines files $machines_status," \
     "the rest $bulk_status"
for status in "$speed_status" "$timeout_status" "$machines_status" "$bulk_status"; do
    if [ "$status" -ne 0 ]; then
        exit "$status"
    fi
done
