# Shared by scripts/test and scripts/checks: `step NAME` starts a timed
# phase; the table of phases is printed however the script ends. Source it
# after `set -euo pipefail`; it prints phases with `log` if defined.
STEP_NAMES=()
STEP_TIMES=()
STEP_AT=$SECONDS
step_end() {
  if [[ ${#STEP_NAMES[@]} -gt ${#STEP_TIMES[@]} ]]; then
    STEP_TIMES+=($((SECONDS - STEP_AT)))
  fi
}
step() {
  step_end
  STEP_NAMES+=("$1")
  STEP_AT=$SECONDS
  printf '\n== %s\n' "$1"
}
# step_table TITLE: the phases so far and their seconds.
step_table() {
  step_end
  printf '\n== %s (s)\n' "$1"
  for i in "${!STEP_NAMES[@]}"; do
    printf '%6d  %s\n' "${STEP_TIMES[$i]}" "${STEP_NAMES[$i]}"
  done
  printf '%6d  in all\n' "$SECONDS"
}
