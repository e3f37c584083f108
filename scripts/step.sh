# Sourced by the GPU check scripts: `step NAME COMMAND...` runs the command
# with its output in LOGS/NAME.log, prints PASS or FAIL with the seconds it
# took (and the log's tail on failure), and counts failures in `failures`.
# The caller sets `logs` and `failures=0`.
step() {
  local name="$1"
  shift
  local start=${SECONDS}
  if "$@" >"${logs}/${name}.log" 2>&1; then
    echo "PASS ${name} ($((SECONDS - start)) s)"
  else
    echo "FAIL ${name} ($((SECONDS - start)) s): tail of ${name}.log"
    tail -n 15 "${logs}/${name}.log"
    failures=$((failures + 1))
  fi
}
