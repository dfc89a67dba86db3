#!/bin/sh
# The image's install steps (the Dockerfile runs this; tests/test_image.py runs it in a clean virtualenv
# so that it cannot rot): a virtualenv at PREFIX holding scrubgate from SOURCE with the `server` extra (the
# webhook, the agent, reports: what `pip install scrubgate` leaves out for CI's `check`) and the `gpu` extra,
# byte-compiled at build time because the container's root filesystem is read-only at run time.
#   tools/install-image.sh SOURCE PREFIX
set -eu

if [ "$#" -ne 2 ]; then
  echo "usage: $0 SOURCE PREFIX (SOURCE: a scrubgate checkout or wheel; PREFIX: the virtualenv to create)" >&2
  exit 2
fi
source_dir="$1"
prefix="$2"
python="${PYTHON:-python3}"

"$python" -m venv "$prefix"
"$prefix/bin/python" -m pip install --quiet --no-warn-script-location --disable-pip-version-check "$source_dir[server,gpu]"
# pip is not needed at run time and is a tool an intruder would like to find.
"$prefix/bin/python" -m pip uninstall --quiet --yes pip
"$prefix/bin/python" -m compileall -q "$prefix/lib"
# The smoke test: the entry point starts, and the code of what runs in a cluster imports.
"$prefix/bin/scrubgate" --version
# -I: not from the source directory (its scrubgate/ would shadow the installed package).
"$prefix/bin/python" -I -c "import scrubgate.webhook.app, scrubgate.sanitizer_agent.agent, scrubgate.reports, kubernetes, pynvml, cuda.bindings"
