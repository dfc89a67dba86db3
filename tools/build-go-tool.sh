#!/usr/bin/env bash
# Builds a tool from its Go module (tools/<TOOL>/go.mod: a `tool` line names its package, and the module it is
# in pins the version) into a cache keyed by tool and version: ${SCRUBGATE_CACHE:-~/.cache/scrubgate}/<TOOL>/
# v$VERSION/<TOOL>. A second run with the cache present does no work. Prints nothing on stdout but the binary's
# path, so that `helm="$(tools/build-go-tool.sh helm)"` works.
#   tools/build-go-tool.sh helm       helm v4, for the chart tests and the helm install e2e
#   tools/build-go-tool.sh promtool   Prometheus' promtool, for `promtool test rules` over the alerts
set -euo pipefail

tool="${1:?usage: tools/build-go-tool.sh helm|promtool}"
here="$(cd "$(dirname "$0")" && pwd)"
module="$here/$tool"
package="$(sed -n 's/^tool \(.*\)$/\1/p' "$module/go.mod" 2>/dev/null | head -1)"
if [[ -z "$package" ]]; then
  echo "$tool-bin: ERROR: $module/go.mod names no tool; restore it from git" >&2
  exit 1
fi
# The required module the package is in, and its version.
read -r required version < <(awk -v pkg="$package" '
  /^\t[^ ]+ v[^ ]+/ { if (index(pkg "/", $1 "/") == 1 && length($1) > length(best)) { best = $1; v = $2 } }
  END { print best, v }' "$module/go.mod")
version="${version#v}"
if [[ -z "$version" ]]; then
  echo "$tool-bin: ERROR: $module/go.mod requires no module for $package; restore it from git" >&2
  exit 1
fi
cache="${SCRUBGATE_CACHE:-$HOME/.cache/scrubgate}/$tool/v$version"

if [[ -x "$cache/$tool" ]]; then
  echo "$cache/$tool"
  exit 0
fi

if ! command -v go >/dev/null 2>&1; then
  echo "$tool-bin: ERROR: 'go' is not on PATH. The tests use $tool v$version built from its Go module" >&2
  echo "($required) with Go >= 1.26 (https://go.dev/doc/install); install Go and run" >&2
  echo "'make $tool-bin' again, or put a $tool v$version at $cache/$tool." >&2
  exit 1
fi

case "$tool" in
  helm) ldflags="-X $required/internal/version.version=v$version -X $required/internal/version.gitTreeState=clean" ;;
  promtool) ldflags="-X github.com/prometheus/common/version.Version=$version" ;;
  *) ldflags="" ;;
esac
mkdir -p "$cache"
echo "$tool-bin: building $tool v$version into $cache (a one-time build, a few minutes on 2 cores)" >&2
start=$(date +%s)
# Build to a temporary name and rename, so that an interrupted build never leaves a binary the check above takes.
(cd "$module" && go build -trimpath -ldflags "$ldflags" -o "$cache/$tool.partial" "$package")
mv "$cache/$tool.partial" "$cache/$tool"
echo "$tool-bin: done in $(( $(date +%s) - start )) s" >&2
echo "$cache/$tool"
