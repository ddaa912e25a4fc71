"""TorchX component: train the pinads_rec ranker on any TorchX scheduler.

From the repository root, with the project's venv activated or not (``.venv/bin/torchx`` works
from a fresh shell: the ranks find the torchrun of the environment torchx runs from)::

    torchx run components/train.py:train -j 1x2 --config configs/demo.yaml --set train.max_steps=50,data.batch_size=256
    torchx run components/train.py:train -j 1x8 --config configs/my_experiment.yaml     # 8 GPUs
    torchx run -s slurm components/train.py:train -j 2x8 --config ...                   # 2 nodes
    torchx run components/train.py:train -j 2x1 --rdzv_port 0 --gpu 0                   # 2 "nodes" here

It wraps ``torchx.components.dist.ddp`` (torchrun on every node) with the project's defaults.
The scheduler (``-s``) is chosen on the command line or in ``.torchxconfig``; this function does
not depend on it. See docs/launching.md.

What each scheduler must provide on every node (the component assumes it, it cannot check it):
  * local_cwd: nothing; the nodes are processes of this machine, in the repository root.
  * slurm: the repository and its ``.venv`` on a shared filesystem at the same path on every node
    (``make setup`` run once on a GPU node; sbatch runs in the submitting directory, or in a
    snapshot of it with ``-cfg job_dir=...``), submitted with that venv's torchx: each node's PATH
    then starts with the venv's bin directory (``torchrun_of_this_environment``). TorchX 0.7's
    Slurm scheduler runs no container image (no pyxis/enroot), so ``--image`` is ignored there.
  * kubernetes and other container schedulers: ``--image``, the image built by the repository's
    Dockerfile (the project installed with its CUDA stack, the repository root as workdir).

Notes for whoever edits this file:
  * TorchX builds the CLI from the signature and the docstring: every parameter needs a type
    annotation from torchx's supported set and an ``Args:`` entry.
  * TorchX ``exec``s this file inside one of its own modules, so ``__file__`` is not this file:
    use paths relative to the working directory (the repository root), never ``__file__``; code
    shared with components/plan.py lives in the installed package (``pinads_rec``), which imports
    here as anywhere (this directory is not on ``sys.path``).
  * No ``from __future__ import annotations``: TorchX reads the annotations as real types.
"""

import os
import shlex
import socket
import sys
import sysconfig
from typing import Dict, List, Optional

import torchx.components.dist as torchx_dist
import torchx.specs as specs

from pinads_rec.config import split_overrides

PINADS_SCRIPT = "pinads_rec/train.py"
PINADS_DEFAULT_CONFIG = "configs/demo.yaml"
# The tag the Dockerfile's build command in docs/launching.md gives the image; push it to a
# registry the cluster pulls from and pass that name as --image.
PINADS_IMAGE = "pinads_rec:latest"

# Per launched process, used when cpu / memMB / gpu are left at -1 ("auto").
PINADS_CPU_PER_PROC = 4
PINADS_MEM_MB_PER_PROC = 16 * 1024
PINADS_GPU_PER_PROC = 1

# Environment for every rank; --env entries are applied on top.
#  - OMP_NUM_THREADS=1: what torchrun would set anyway (minus its warning); train.py sizes torch's
#    intra-op pool itself (CPUs / local ranks), this only keeps other OpenMP users single-threaded.
#  - PYTHONPATH=.: the working directory is the repository root on every scheduler (local_cwd runs
#    in it, container schedulers in the image's workdir), so `pinads_rec` imports without an
#    install.
#  - TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the store shared between torchrun's rendezvous and
#    the workers, restarted workers can read the previous round's gloo/NCCL addresses and fail to
#    connect (pytorch/pytorch#135712); a separate store per round makes restarts work. Neither
#    TorchX 0.7 nor torchrun sets it (torch 2.13 shares the store by default), and it matters most
#    across nodes, where a restarted node must not reach the last round's addresses.
PINADS_ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": ".", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def repeated_set_flags(argv: List[str]) -> int:
    """How many ``--set`` flags a ``torchx run ... components/train.py:train ...`` command line gives
    this component (script arguments after ``--`` excluded); 0 when not run by the torchx CLI.

    torchx rejects ``--set a=1 --set b=2`` ("Repeated Command Line Arguments") but not
    ``--set=a=1 --set=b=2``, of which its argparse would silently keep only the last.
    """
    if not argv or os.path.basename(argv[0]) != "torchx":
        return 0
    start = next((i + 1 for i, a in enumerate(argv) if a.endswith("train.py:train")), None)
    if start is None:
        return 0
    rest = argv[start:]
    rest = rest[: rest.index("--")] if "--" in rest else rest
    return sum(1 for a in rest if a == "--set" or a.startswith("--set="))


def with_nproc(j: str, nproc: int) -> str:
    """Replaces the processes-per-node part of a ``-j`` spec (``2x4``, ``1:2x4``, ``4``); 0 keeps it."""
    torchx_dist.parse_nnodes(j)  # raises a clear ValueError on a malformed -j
    if nproc == 0:
        return j
    if nproc < 0:
        raise ValueError(f"--nproc must be >= 1 (or 0: take it from -j), got {nproc}")
    nodes = j.rsplit("x", 1)[0] if "x" in j else "1"
    return f"{nodes}x{nproc}"


def torchrun_of_this_environment(app: specs.AppDef) -> specs.AppDef:
    """Puts the bin directory of the interpreter running torchx first on each node's PATH for its
    ``bash -c "torchrun ..."`` (dist.ddp names torchrun by name alone), when that directory holds a
    torchrun: ``.venv/bin/torchx run ...`` then launches from a fresh shell, without the venv
    activated, and the nodes run the torch of the environment that built the job.

    Why in the command, not in the role's ``env``: local_cwd prepends an env PATH to its own, but
    Slurm (``--export``) and Kubernetes replace the node's PATH with it. In the command the node's
    own PATH follows, so a node without this directory (a container: the image's torchrun) is
    unaffected, and a Slurm node on the shared filesystem finds the same venv."""
    scripts = sysconfig.get_path("scripts")
    if not os.path.isfile(os.path.join(scripts, "torchrun")):
        return app
    for role in app.roles:
        # $$: TorchX's escape for a literal $ in role arguments (dist.ddp escapes its endpoint so).
        role.args[-1] = f'PATH={shlex.quote(scripts)}:"$$PATH" {role.args[-1]}'
    return app


def free_port() -> int:
    """A TCP port that is free on this machine now, picked by the OS (bound on all interfaces, as
    torchrun's c10d store binds). Another process may take it before torchrun does: rare, and the
    launch then fails at once with "address already in use" rather than hanging."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def train(
    *script_args: str,
    config: str = PINADS_DEFAULT_CONFIG,
    set: Optional[str] = None,
    j: str = "1x2",
    nproc: int = 0,
    script: str = PINADS_SCRIPT,
    name: str = "pinads_rec/train",
    image: str = PINADS_IMAGE,
    h: Optional[str] = None,
    cpu: int = -1,
    gpu: int = -1,
    memMB: int = -1,
    env: Optional[Dict[str, str]] = None,
    max_retries: int = 2,
    mounts: Optional[List[str]] = None,
    rdzv_port: int = 29500,
    debug: bool = False,
) -> specs.AppDef:
    """
    Trains the pinads_rec ranker (pinads_rec/train.py) with torchrun on every node.

    The same component runs on every TorchX scheduler: pick one with ``-s`` (local_cwd, slurm,
    kubernetes, ...) and its options with ``-cfg``. On one machine with 8 GPUs change only
    ``-j 1x8``.

    Args:
        script_args: extra arguments for pinads_rec/train.py, after ``--`` (e.g. ``-- --set a=1,b=2``)
        config: experiment YAML, relative to the repository root
        set: config overrides ``key.path=value``, several in one flag separated by commas (``--set train.max_steps=50,data.batch_size=256``; TorchX refuses a repeated ``--set``)
        j: ``[{min_nnodes}:]{nnodes}x{nproc_per_node}``: nodes x processes per node (one process per GPU; on CPU, gloo ranks)
        nproc: shorthand that replaces the processes-per-node part of ``-j``; 0: keep ``-j``
        script: training script run by torchrun on every node
        name: job name ``{experiment}/{run}``
        image: image with the project's environment (the repository's Dockerfile), for container schedulers (docker, kubernetes); ignored by local_cwd and slurm
        h: a registered named resource; takes precedence over cpu, gpu and memMB
        cpu: CPUs per node; -1: 4 per process
        gpu: GPUs per node; -1: one per process; set 0 for CPU-only clusters
        memMB: memory per node in MB; -1: 16 GiB per process
        env: extra environment variables ``A=1,B=2``, applied over the defaults (OMP_NUM_THREADS=1, PYTHONPATH=., TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
        max_retries: scheduler-level retries of the whole job (ignored by the local schedulers); train.py resumes from the latest checkpoint in train.run_dir
        mounts: mounts for container schedulers: ``type=<bind/volume>,src=/host,dst=/job[,readonly]``
        rdzv_port: port on the first node for the c10d rendezvous (multi-node only); 0: a port free on this machine when the job is built, for several nodes on this machine (``-s local_cwd -j 2x1``); on a cluster give a fixed one
        debug: turn on torch.distributed's debug flags
    """
    if repeated_set_flags(sys.argv) > 1:
        raise ValueError(
            "--set given more than once: torchx keeps only the last. Give several overrides in one "
            "--set separated by commas: --set a.b=1,c.d=2"
        )
    j = with_nproc(j, nproc)
    _, max_nnodes, nproc_per_node, _ = torchx_dist.parse_nnodes(j)
    if not 0 <= rdzv_port <= 65535:
        raise ValueError(f"--rdzv_port must be a TCP port in [0, 65535], got {rdzv_port}")
    if rdzv_port == 0 and max_nnodes > 1:
        # dist.ddp would hand port 0 to every node's torchrun: each would open a store of its own on
        # a random port and wait for the others until the rendezvous times out. One port, picked now,
        # for all of them. (On one node dist.ddp uses localhost:0 itself: one torchrun, no one to meet.)
        rdzv_port = free_port()

    run_env = dict(PINADS_ENV)
    run_env.update(env or {})

    args = ["--config", config]
    for assignment in split_overrides(set):
        args += ["--set", assignment]
    args += list(script_args)

    app = torchx_dist.ddp(
        *args,
        script=script,
        name=name,
        image=image,
        h=h,
        cpu=cpu if cpu >= 0 else PINADS_CPU_PER_PROC * nproc_per_node,
        gpu=gpu if gpu >= 0 else PINADS_GPU_PER_PROC * nproc_per_node,
        memMB=memMB if memMB >= 0 else PINADS_MEM_MB_PER_PROC * nproc_per_node,
        j=j,
        env=run_env,
        max_retries=max_retries,
        mounts=mounts,
        rdzv_port=rdzv_port,
        debug=debug,
    )
    return torchrun_of_this_environment(app)
