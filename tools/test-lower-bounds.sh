#!/bin/sh
# CI: the webhook's and check's tests on the oldest versions pyproject.toml allows. A virtualenv (build/lowest) gets
# the lowest version each runtime dependency's bound admits (uv's --resolution lowest-direct: the bounds of
# [project].dependencies and of every extra but `test`; what those need, at their newest), then the test extra
# without moving any of them. A bound that no longer works fails here, not on a user's install.
#   tools/test-lower-bounds.sh [PYTEST ARGS...]   (default: the webhook's and check's test files)
set -eu
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
venv=build/lowest

rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check uv
extras=$("$venv/bin/python" -c 'import tomllib
extras = tomllib.load(open("pyproject.toml", "rb"))["project"].get("optional-dependencies", {})
print(",".join(sorted(name for name in extras if name != "test")))')
uv() { "$venv/bin/uv" --quiet "$@"; }
uv pip install --python "$venv/bin/python" --resolution lowest-direct -e ".[$extras]"
uv pip freeze --python "$venv/bin/python" --exclude-editable >"$venv/runtime.txt"
uv pip install --python "$venv/bin/python" --constraint "$venv/runtime.txt" -e ".[test]"
echo "== tests on the runtime dependencies at their lower bounds (extras: $extras); the runtime environment:"
tr '\n' ' ' <"$venv/runtime.txt"
echo
if [ "$#" -eq 0 ]; then
  set -- tests/test_webhook_*.py tests/test_connection_bounds.py tests/test_check_*.py
fi
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
