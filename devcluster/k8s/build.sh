#!/usr/bin/env bash
# Builds etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kubectl from their Go modules
# into a cache keyed by version: ${SCRUBGATE_CACHE:-~/.cache/scrubgate}/k8s/v$K8S_VERSION/bin.
# A second run with the cache present does no work.
#
# The default version is the one go.mod beside this script pins. Another (K8S_VERSION=1.34.4) gets a
# go.mod generated the same way: k8s.io/kubernetes at that release, every k8s.io/* staging module its
# go.mod replaces with ./staging replaced by the published v0.<minor>.<patch>, and the etcd server the
# release itself depends on.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
pinned="$(sed -n 's/^\tk8s.io\/kubernetes v\([^ ]*\).*/\1/p' "$here/go.mod")"
version="${K8S_VERSION:-$pinned}"
version="${version#v}"
cache="${SCRUBGATE_CACHE:-$HOME/.cache/scrubgate}/k8s/v$version"
bins=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl)

if [[ -f "$cache/bin/.complete" ]]; then
  echo "cluster-bins: Kubernetes v$version already built in $cache/bin"
  exit 0
fi

if ! command -v go >/dev/null 2>&1; then
  echo "cluster-bins: ERROR: 'go' is not on PATH. The Kubernetes control plane for the demo and the" >&2
  echo "end-to-end tests is built from source with Go >= 1.26 (https://go.dev/doc/install); install it" >&2
  echo "and run 'make cluster-bins' again." >&2
  exit 1
fi

mkdir -p "$cache/bin"
module="$here"
if [[ "$version" != "$pinned" ]]; then
  # A module for another release, generated beside the cache so that the repository stays untouched.
  module="$cache/src"
  mkdir -p "$module"
  echo "cluster-bins: resolving k8s.io/kubernetes v$version from the Go module proxy"
  gomod="$(cd "$module" && GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@v$version" \
    | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
  etcd="$(sed -n 's/^\tgo.etcd.io\/etcd\/server\/v3 \(v[^ ]*\).*/\1/p' "$gomod")"
  staging="$(sed -n 's/^\t\(k8s.io\/[^ ]*\) => .\/staging.*/\1/p' "$gomod")"
  minor_patch="${version#*.}"
  {
    printf 'module scrubgate.dev/devcluster/k8s\n\ngo 1.26.0\n\nrequire (\n'
    printf '\tk8s.io/kubernetes v%s\n\tgo.etcd.io/etcd/server/v3 %s\n)\n\n' "$version" "$etcd"
    sed -n '/^tool (/,/^)/p' "$here/go.mod"
    printf '\nreplace (\n'
    for m in $staging; do printf '\t%s => %s v0.%s\n' "$m" "$m" "$minor_patch"; done
    printf ')\n'
  } > "$module/go.mod"
  (cd "$module" && go mod tidy)
fi

major="${version%%.*}"
minor="${version#*.}"; minor="${minor%%.*}"
build_date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
ldflags=""
# What `kubectl version` and the API server's /version report, as hack/lib/version.sh sets them.
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=v$version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
done

echo "cluster-bins: building ${bins[*]} for Kubernetes v$version into $cache/bin"
echo "cluster-bins: a one-time build; about 15-25 minutes on 2 cores, later runs reuse it"
start=$(date +%s)
cd "$module"
for tool in $(sed -n '/^tool (/,/^)/{s/^\t\(.*\)/\1/p}' go.mod); do
  name="$(basename "$tool")"
  [[ "$name" == v3 ]] && name=etcd
  t0=$(date +%s)
  echo "cluster-bins:   $name ..."
  go build -trimpath -ldflags "$ldflags" -o "$cache/bin/$name" "$tool"
  echo "cluster-bins:   $name built in $(( $(date +%s) - t0 )) s"
done
touch "$cache/bin/.complete"
echo "cluster-bins: done in $(( $(date +%s) - start )) s: $cache/bin"
