"""TorchX component: plan the sharding of a pinads_rec config for a target cluster (no GPU needed).

From the repository root, with the project's virtual environment active (``python`` must be the
venv's on PATH)::

    torchx run -s local_cwd components/plan.py:plan --config configs/prod_8gpu.yaml \\
        --world_size 16 --local_world_size 8 --hbm_gb 80 --ddr_gb 512 --batch_size 4096
    torchx run components/plan.py:plan --config configs/prod_8gpu.yaml --world_size 8 \\
        --out runs/plan_1x8.json --compare "world_size=16"

It runs one process, ``python -m pinads_rec.plan ...`` (TorchRec's planner offline, on the model
built on the meta device), and prints the plan: tables, per-rank memory and cost, critical path.
See docs/planning.md. On a container scheduler the plan file lands in the container: give
``--out`` a path on a mounted volume (``--mounts``).

Notes for whoever edits this file (as for components/train.py):
  * every parameter needs a torchx-supported type annotation and an ``Args:`` entry;
  * TorchX ``exec``s this file inside one of its own modules: no ``__file__`` (paths are relative
    to the working directory, the repository root), and imports from the repository only from the
    installed package (``pinads_rec``; this directory is not on ``sys.path``);
  * no ``from __future__ import annotations``: TorchX reads the annotations as real types.
"""

from typing import Dict, List, Optional

import torchx.specs as specs

from pinads_rec.config import split_overrides

PINADS_PLAN_MODULE = "pinads_rec.plan"
PINADS_DEFAULT_CONFIG = "configs/demo.yaml"
PINADS_IMAGE = "pinads_rec:latest"  # built by the repository's Dockerfile (as in components/train.py)
# The planner runs on CPU in one process; the model's dense part is materialized (embeddings are
# on the meta device), so a few GB suffice even for the production config.
PINADS_PLAN_CPU = 2
PINADS_PLAN_MEM_MB = 8 * 1024
PINADS_ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": "."}


def plan_args(
    config: str,
    world_size: int,
    local_world_size: int,
    compute_device: str,
    hbm_gb: float,
    ddr_gb: float,
    batch_size: int,
    hbm_bw: float,
    ddr_bw: float,
    intra_host_bw: float,
    inter_host_bw: float,
    reserve_pct: float,
    sharding_types: Optional[str],
    set: Optional[str],
    no_pooling_factors: bool,
    candidates_per_request: float,
    out: Optional[str],
    compare: Optional[str],
    compare_config: Optional[str],
    verbose: bool,
) -> List[str]:
    """The ``python -m pinads_rec.plan`` arguments for the component's parameters."""
    args = [
        "--config",
        config,
        "--world-size",
        str(world_size),
        "--compute-device",
        compute_device,
        "--hbm-gb",
        repr(hbm_gb),
        "--ddr-gb",
        repr(ddr_gb),
        "--reserve-pct",
        repr(reserve_pct),
    ]
    if local_world_size > 0:
        args += ["--local-world-size", str(local_world_size)]
    if batch_size > 0:
        args += ["--batch-size", str(batch_size)]
    args += [
        "--hbm-bw",
        repr(hbm_bw),
        "--ddr-bw",
        repr(ddr_bw),
        "--intra-host-bw",
        repr(intra_host_bw),
        "--inter-host-bw",
        repr(inter_host_bw),
    ]
    if sharding_types:
        args += ["--sharding-types", sharding_types]
    for assignment in split_overrides(set):
        args += ["--set", assignment]
    if no_pooling_factors:
        args.append("--no-pooling-factors")
    if candidates_per_request > 0:
        args += ["--candidates-per-request", repr(candidates_per_request)]
    if out:
        args += ["--out", out]
    if compare:
        args += ["--compare", compare]
    if compare_config:
        args += ["--compare-config", compare_config]
    if verbose:
        args.append("--verbose")
    return args


def plan(
    *script_args: str,
    config: str = PINADS_DEFAULT_CONFIG,
    world_size: int = 8,
    local_world_size: int = 0,
    compute_device: str = "cuda",
    hbm_gb: float = 80.0,
    ddr_gb: float = 512.0,
    batch_size: int = 0,
    hbm_bw: float = 897.0,
    ddr_bw: float = 51.0,
    intra_host_bw: float = 600.0,
    inter_host_bw: float = 12.5,
    reserve_pct: float = 15.0,
    sharding_types: Optional[str] = None,
    set: Optional[str] = None,
    no_pooling_factors: bool = False,
    candidates_per_request: float = 0.0,
    out: Optional[str] = None,
    compare: Optional[str] = None,
    compare_config: Optional[str] = None,
    verbose: bool = False,
    name: str = "pinads_rec_plan",
    image: str = PINADS_IMAGE,
    h: Optional[str] = None,
    cpu: int = PINADS_PLAN_CPU,
    memMB: int = PINADS_PLAN_MEM_MB,
    env: Optional[Dict[str, str]] = None,
    mounts: Optional[List[str]] = None,
) -> specs.AppDef:
    """
    Plans the sharding of a pinads_rec config for a target cluster with TorchRec's planner, offline
    (``python -m pinads_rec.plan``): one CPU process, no GPU, no process group. Prints each table's
    sharding, per-rank memory and estimated cost, and the critical path; exits 1 when nothing fits.

    Args:
        script_args: extra arguments for ``python -m pinads_rec.plan``, after ``--``
        config: experiment YAML, relative to the repository root
        world_size: devices (ranks) of the target cluster in all
        local_world_size: devices per host; 0: min(world_size, 8)
        compute_device: device type planned for: cuda or cpu
        hbm_gb: GPU memory per rank in GB (2^30 bytes)
        ddr_gb: host memory per rank in GB
        batch_size: per-rank batch size; 0: the config's data.batch_size
        hbm_bw: HBM bandwidth in GB/s (TorchRec's default)
        ddr_bw: DDR bandwidth in GB/s (TorchRec's default)
        intra_host_bw: comms bandwidth within a host in GB/s (TorchRec's default)
        inter_host_bw: comms bandwidth across hosts in GB/s (TorchRec's default)
        reserve_pct: storage reservation margin, percent of HBM (HeuristicalStorageReservation)
        sharding_types: allowed sharding types, comma-separated (e.g. ``table_wise,row_wise``)
        set: config overrides ``key.path=value``, several separated by commas or spaces (torchx allows one ``--set``)
        no_pooling_factors: plan with one lookup per table and row instead of the sequence lengths
        candidates_per_request: mean candidates per request sizing the sequence lookups; 0: measured from data.train_dir
        out: write the plan as JSON here, for ``--set train.plan_file=...``
        compare: plan a second topology differing in these fields and compare, e.g. ``world_size=8,local_world_size=8``
        compare_config: plan a second config and compare
        verbose: also print TorchRec's planner stats tables
        name: job name
        image: image with the project's environment, for container schedulers; ignored by local_cwd
        h: a registered named resource; takes precedence over cpu and memMB
        cpu: CPUs for the planning process
        memMB: memory for the planning process in MB
        env: extra environment variables ``A=1,B=2``, applied over the defaults (OMP_NUM_THREADS=1, PYTHONPATH=.)
        mounts: mounts for container schedulers: ``type=<bind/volume>,src=/host,dst=/job[,readonly]``
    """
    if compute_device not in ("cuda", "cpu"):
        raise ValueError(f"--compute_device must be cuda or cpu, got {compute_device!r}")
    args = plan_args(
        config,
        world_size,
        local_world_size,
        compute_device,
        hbm_gb,
        ddr_gb,
        batch_size,
        hbm_bw,
        ddr_bw,
        intra_host_bw,
        inter_host_bw,
        reserve_pct,
        sharding_types,
        set,
        no_pooling_factors,
        candidates_per_request,
        out,
        compare,
        compare_config,
        verbose,
    )
    run_env = dict(PINADS_ENV)
    run_env.update(env or {})
    return specs.AppDef(
        name=name,
        roles=[
            specs.Role(
                name="plan",
                image=image,
                entrypoint="python",
                args=["-m", PINADS_PLAN_MODULE, *args, *script_args],
                env=run_env,
                resource=specs.resource(cpu=cpu, gpu=0, memMB=memMB, h=h),
                num_replicas=1,
                mounts=specs.parse_mounts(mounts) if mounts else [],
            )
        ],
    )
