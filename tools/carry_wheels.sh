#!/usr/bin/env bash
# Download, HERE (a machine with network), the wheels that a bare GPU machine lacks to run the GPU check
# (python -m tools.gpucheck): nbval and the Jupyter kernel stack, for CPython 3.12 on manylinux x86_64.
# torch, torchvision, numpy, matplotlib, pillow, psutil, nvidia-ml-py, tqdm, pytest and pytest-timeout are
# already on that machine (see IMAGE_HAS below) and are NOT carried: torch is never reinstalled there.
#
#   tools/carry_wheels.sh            download into .whl/ (ignored by git), then check the set
#   tools/carry_wheels.sh --check    only check .whl/: every requirement met by a carried wheel or the image
#
# Then, on the device machine: four calls of the device tool's `run`, each with carry [".whl"], in this order
# (smoke <= 6 min, bench <= 8, notebooks <= 8, unit <= 3: 25 minutes; timeout_s 420, 540, 540, 240). The machine's
# own torch (2.11 there) is used as it is; the check reports any torch name the workbook uses that it lacks.
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 WORKBOOK_GIT_COMMIT=<sha> || exit; python3 -m tools.gpucheck --steps smoke --logs $OUT --bundle
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 WORKBOOK_GIT_COMMIT=<sha> || exit; python3 -m tools.gpucheck --steps bench --logs $OUT --bundle
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 WORKBOOK_GIT_COMMIT=<sha> || exit; python3 -m tools.gpucheck --steps notebooks --logs $OUT --bundle
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 WORKBOOK_GIT_COMMIT=<sha> || exit; python3 -m tools.gpucheck --steps unit --logs $OUT --bundle
#
# See docs/GPU-CHECK.md ("On a bare machine") for the whole procedure.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl

# Pinned to the versions this workbook is tested with (the project's .venv); pure-Python unless noted.
PINS=(
  nbval==0.11.0
  nbformat==5.11.1
  nbclient==0.11.0
  jupyter_client==8.10.0
  jupyter_core==5.9.1
  ipykernel==7.4.0
  ipython==9.18.1
  ipython_pygments_lexers==1.1.1
  ipywidgets==8.1.9
  widgetsnbextension==4.0.16
  jupyterlab_widgets==3.0.17
  comm==0.2.3
  traitlets==5.16.1
  matplotlib-inline==0.2.2
  debugpy==1.8.22            # binary (cp312)
  pyzmq==27.3.0              # binary
  tornado==6.6.1             # binary (abi3)
  nest-asyncio2==1.7.4
  jedi==0.20.1
  parso==0.8.7
  pexpect==4.9.0
  ptyprocess==0.7.0
  prompt_toolkit==3.0.53
  wcwidth==0.9.4
  stack-data==0.6.3
  executing==2.3.0
  asttokens==3.0.2
  pure_eval==0.2.4
  platformdirs==4.14.7
  fastjsonschema==2.22.3
  jsonschema==4.26.0
  jsonschema-specifications==2025.9.1
  referencing==0.37.0
  rpds-py==2026.9.1          # binary (cp312)
)

# The Python packages the GPU machines' image already holds (/work/.library/device/KINDS.md, read 2026-11-17).
IMAGE_HAS="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"

PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python

if [ "${1:-}" != "--check" ]; then
  mkdir -p "$DEST"
  grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo '/.whl/' >> .git/info/exclude; } || true
  names=()
  for p in "${PINS[@]}"; do names+=("${p%%#*}"); done
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_5_x86_64 -d "$DEST" "${names[@]}"
fi

# Check: one version per package, no torch, every requirement (for CPython 3.12 on Linux x86_64)
# met by a carried wheel or by the image. Versions of the image's packages are not known here.
IMAGE_HAS="$IMAGE_HAS" DEST="$DEST" "$PY" - <<'EOF'
import os, re, sys, zipfile
from pathlib import Path
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "extra": ""}
image = {canonicalize_name(n) for n in os.environ["IMAGE_HAS"].split()}
wheels = sorted(Path(os.environ["DEST"]).glob("*.whl"))
if not wheels:
    sys.exit("no wheels in .whl/: run tools/carry_wheels.sh without --check first")
carried, problems, total = {}, [], 0
for w in wheels:
    name = canonicalize_name(w.name.split("-")[0])
    if name in carried:
        problems.append(f"two versions of {name}: {carried[name][0].name} and {w.name} (keep one)")
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        reqs = [l.split(":", 1)[1].strip() for l in z.read(meta).decode().splitlines() if l.startswith("Requires-Dist:")]
    carried[name] = (w, reqs)
    total += w.stat().st_size
for bad in ("torch", "torchvision", "numpy", "nvidia-ml-py"):
    if bad in carried:
        problems.append(f"{bad} must not be carried: the machine's own build is used")
for name, (w, reqs) in carried.items():
    for r in reqs:
        req = Requirement(r)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        dep = canonicalize_name(req.name)
        if dep not in carried and dep not in image:
            problems.append(f"{w.name} needs {r!r}: neither carried nor on the image")
print(f"{len(wheels)} wheels in .whl/, {total / 2**20:.1f} MiB in all (the device tool carries at most 64 MiB with the tree)")
if problems:
    print("PROBLEMS:\n  " + "\n  ".join(problems))
    sys.exit(1)
print("ok: every requirement is met by a carried wheel or by the image (image versions unchecked)")
EOF
