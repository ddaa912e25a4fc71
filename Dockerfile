# The image TorchX's container schedulers run (-s kubernetes, local_docker, ...): the project
# installed with its CUDA stack from the CUDA lock file, the repository root as working directory
# (components/train.py runs `torchrun pinads_rec/train.py --config configs/...` from there).
#
#   docker build -t pinads_rec:latest .        # from the repository root; see docs/launching.md
#
# No NVIDIA base image: the torch and fbgemm-gpu wheels bring their CUDA runtime libraries as pip
# packages (nvidia-*, in the lock); the GPU driver comes from the node (NVIDIA container toolkit).
# Python must be the one the lock was resolved with (its wheels are cp311).
FROM python:3.11.7-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

WORKDIR /workspace

# pip, not scripts/setup_env.sh: the script chooses the CUDA or CPU lock by asking nvidia-smi,
# which a docker build does not have, and builds a .venv inside the repository. --no-deps: the lock
# already names every package at its exact version, transitive ones included; resolving again
# could only add what the lock left out. Copied alone first so this layer (several GB) is rebuilt
# only when the lock changes.
COPY locks/cuda.txt locks/cuda.txt
RUN python -m pip install --no-deps -r locks/cuda.txt

# The repository (what .dockerignore leaves: no .venv, data, runs or .git), then the package itself,
# editable so that TorchX's workspace layer (`COPY . .` over this directory) replaces its code too.
# pip check fails the build if the lock does not hold together (a missing or mismatched dependency).
COPY . .
RUN python -m pip install --no-deps -e . && python -m pip check
