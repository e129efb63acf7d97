#!/usr/bin/env bash
# The test suite against other torch (and transformers) versions than the pinned one, each in its own virtual
# environment, to check the range pyproject.toml declares.  Prints one line per version and leaves each log.
#
#   benchmarks/torch_versions.sh OUT_DIR TORCH_VERSION[:TRANSFORMERS_VERSION] ...
#   e.g. benchmarks/torch_versions.sh /tmp/tv 2.7.1:4.48.0 2.8.0 2.14.1
#
# PyPI's Linux torch wheels are CUDA builds with multi-GB dependencies (about 6 GB a venv); they run on a CPU-only
# machine.  Each venv gets torch first, then this checkout as `-e .[dev]` (which keeps that torch), then the
# transformers version if one is given.  The native kernels build into OUT_DIR/cache-VERSION.  Logs:
# OUT_DIR/VERSION.log; the venvs (OUT_DIR/venv-VERSION) are left for a rerun (an existing one is used as it is):
# delete them after.  TESTS="tests/x.py -k y" runs those instead of the whole suite.  PYTHON=/path/to/python3.12
# builds the venvs with that interpreter (use a separate OUT_DIR per interpreter).
set -uo pipefail
out=${1:?usage: torch_versions.sh OUT_DIR TORCH_VERSION[:TRANSFORMERS_VERSION] ...}
shift
[ $# -gt 0 ] || { echo "torch_versions.sh: name at least one torch version, e.g. 2.8.0" >&2; exit 2; }
cd "$(dirname "$0")/.."
mkdir -p "$out"
py=${PYTHON:-python3}
for spec in "$@"; do
    tv=${spec%%:*}
    hv=$([[ $spec == *:* ]] && echo "${spec#*:}" || true)
    name=$tv${hv:+-transformers$hv}
    venv=$out/venv-$name
    log=$out/$name.log
    if [ ! -x "$venv/bin/python" ]; then
        ( $py -m venv "$venv" && "$venv/bin/pip" install -q "torch==$tv" && "$venv/bin/pip" install -q -e ".[dev]" &&
            { [ -z "$hv" ] || "$venv/bin/pip" install -q "transformers==$hv"; } ) >"$out/$name.install.log" 2>&1 ||
            { echo "$name: install failed ($out/$name.install.log)"; rm -rf "$venv"; continue; }
    fi
    versions=$("$venv/bin/python" -c "import importlib.metadata as m, platform, torch
try: tf = m.version('transformers')
except m.PackageNotFoundError: tf = 'none'
print('python', platform.python_version(), 'torch', torch.__version__, 'transformers', tf)" 2>&1 | tail -1)
    t0=$SECONDS
    # shellcheck disable=SC2086  # TESTS: words for pytest
    DIFFTX_CACHE_DIR=$out/cache-$name "$venv/bin/python" -m pytest -p no:cacheprovider -rfE ${TESTS:-} >"$log" 2>&1
    rc=$?
    echo "$name: $versions: rc=$rc in $((SECONDS - t0)) s: $(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' \
"$log" | tail -1 | tr -d '=')"
done
