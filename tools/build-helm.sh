#!/usr/bin/env bash
# Builds helm from its Go module (the version tools/helm/go.mod pins) into a cache keyed by version:
# ${SCRUBGATE_CACHE:-~/.cache/scrubgate}/helm/v$VERSION/helm. A second run with the cache present does
# no work. Prints nothing on stdout but the binary's path, so that `helm="$(tools/build-helm.sh)"` works.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
module="$here/helm"
version="$(sed -n 's/^\thelm.sh\/helm\/v4 v\([^ ]*\).*/\1/p' "$module/go.mod")"
if [[ -z "$version" ]]; then
  echo "helm-bin: ERROR: $module/go.mod requires no helm.sh/helm/v4; restore it from git" >&2
  exit 1
fi
cache="${SCRUBGATE_CACHE:-$HOME/.cache/scrubgate}/helm/v$version"

if [[ -x "$cache/helm" ]]; then
  echo "$cache/helm"
  exit 0
fi

if ! command -v go >/dev/null 2>&1; then
  echo "helm-bin: ERROR: 'go' is not on PATH. The chart tests use helm v$version built from its Go module" >&2
  echo "(helm.sh/helm/v4) with Go >= 1.26 (https://go.dev/doc/install); install Go and run" >&2
  echo "'make helm-bin' again, or put a helm v$version at $cache/helm." >&2
  exit 1
fi

mkdir -p "$cache"
ldflags="-X helm.sh/helm/v4/internal/version.version=v$version -X helm.sh/helm/v4/internal/version.gitTreeState=clean"
echo "helm-bin: building helm v$version into $cache (a one-time build, a few minutes on 2 cores)" >&2
start=$(date +%s)
# Build to a temporary name and rename, so that an interrupted build never leaves a binary the check above takes.
(cd "$module" && go build -trimpath -ldflags "$ldflags" -o "$cache/helm.partial" helm.sh/helm/v4/cmd/helm)
mv "$cache/helm.partial" "$cache/helm"
echo "helm-bin: done in $(( $(date +%s) - start )) s" >&2
echo "$cache/helm"
