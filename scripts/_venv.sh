# Sourced by scripts/test and scripts/demo: create or refresh ./.venv when pyproject.toml changes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PYTHON="${PYTHON:-python3}"

ensure_venv() {
  local extras="$1"
  if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "jobfence needs Python 3.11 or newer (found: $("$PYTHON" --version 2>&1))" >&2
    exit 1
  fi
  local stamp="$VENV/.jobfence-stamp"
  local want
  want="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1) $extras"
  if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  echo "setting up $VENV (extras: $extras) ..." >&2
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT[$extras]" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
  "$VENV/bin/python" -c 'import jobfence' || { echo "installing jobfence failed" >&2; exit 1; }
  echo "$want" > "$stamp"
}
