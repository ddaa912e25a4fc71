"""What managed collision costs: the daily loop's model with its ad table of 500 rows hashed
against the same table under TorchRec's managed collision (configs/continuous_managed.yaml), side
by side on the same day of the drifting world.

    python benchmarks/managed_collision.py [--requests 6000] [--steps 50] [--repeats 3] [--ranks 2] [--work DIR]
        [--set KEY=VALUE ...]

Generates two days of the drifting world (the first to train on), then times plain training steps
of each variant on ``--ranks`` gloo ranks (``harness.measure_training``: forward, backward,
optimizer, after 5 warm-up steps), the two alternating ``--repeats`` times so that a busy machine
slows both alike. The managed one's eviction rounds come every ``eviction_interval`` steps (50 in
the config): the default 50 timed steps hold one. Prints each repeat's ms per step and examples/s,
the median ratio managed / hashed, each rank's embedding MiB and peak RSS, and the id map the
managed table keeps beside its rows.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from pinads_rec import config
from pinads_rec.data import synth
from pinads_rec.experiments import harness
from pinads_rec.managed_collision import id_map_bytes

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "continuous_managed.yaml"
WARMUP = 5
VARIANTS = {
    "hashed": ["features.tables.item.managed_collision=null", "features.tables.item.hash=true"],
    "managed": [],
}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=6000, help="requests of the day trained on (default: %(default)s)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    config.add_overrides_flag(p, "an override of both variants (e.g. data.batch_size=256)")
    args = p.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="managed_collision_"))
    world = ["synth.drift.days=2", f"synth.drift.requests_per_day={args.requests}"] + args.overrides
    base = config.load(str(CONFIG), world)
    synth.ensure(base, work / "data")
    days = [work / "data" / "days" / d for d in synth.day_names(base.synth)]
    data = [f"data.train_dir={days[0]}", f"data.eval_dir={days[1]}", "data.num_workers=0"]
    cfgs = {name: config.load(str(CONFIG), world + data + extra) for name, extra in VARIANTS.items()}
    ms = {name: [] for name in cfgs}
    ranks = {}
    for r in range(args.repeats):
        for name, cfg in cfgs.items():
            out = harness.rank_results(
                harness.measure_training, args.ranks, work / "runs" / f"{name}-{r}", cfg, WARMUP, args.steps, 0
            )
            ms[name].append(max(sum(o[f"{k}_ms"] for k in ("forward", "backward", "optimizer")) for o in out))
            ranks[name] = out
    batch = base.data.batch_size * args.ranks
    ratio = statistics.median(m / h for m, h in zip(ms["managed"], ms["hashed"]))
    print(
        f"Drifting world, a day of {args.requests:,} requests; {args.ranks} gloo rank(s), batch {batch:,}; "
        "ms per training step (forward + backward + optimizer, the slowest rank):"
    )
    for name, values in ms.items():
        rates = "  ".join(f"{batch / v * 1000:8,.0f}" for v in values)
        memory = "  ".join(
            f"rank {o['rank']}: {o['embedding_mib']:.2f} MiB, peak RSS {o['peak_rss_mib']:,.0f}" for o in ranks[name]
        )
        print(f"  {name:8s} " + "  ".join(f"{v:7.2f}" for v in values) + f"   examples/s {rates}   ({memory})")
    id_map = id_map_bytes(cfgs["managed"].features.table("item"))
    print(f"managed / hashed: {ratio:.3f}x step time (median of {args.repeats}), {1 / ratio:.3f}x examples/s")
    print(f"the managed item table's id map: {id_map / 2**20:.2f} MiB over all ranks, beside its rows")
    return {"ms": ms, "ratio": ratio, "id_map_bytes": id_map}


if __name__ == "__main__":
    main()
