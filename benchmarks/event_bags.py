"""What a multi-valued event attribute costs: the MovieLens config's history with each liked
movie's genres as a bag (``max_values: 6``, averaged) against its first genre only, side by side.

    python benchmarks/event_bags.py [--users 943] [--steps 40] [--repeats 3] [--work DIR]

Generates MovieLens-shaped files (``pinads_rec.data.shaped_logs.movielens``), builds them both ways
(``first_genre_config``), then times plain training steps of each on one rank
(``harness.measure_training``: forward, backward, optimizer; after a warm-up), the two variants
alternating ``--repeats`` times so that a busy machine slows both alike. Prints the ms per step of
each repeat, the median ratio bags / first genre, and the training files' sizes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from pinads_rec.data.build import build
from pinads_rec.data.shaped_logs import config_with_truth, movielens
from pinads_rec.experiments import harness

WARMUP = 5


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=943)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    args = p.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="event_bags_"))
    movielens.write(work / "raw", users=args.users)
    variants = {}
    for name, make in (
        ("bags", lambda o: config_with_truth("movielens", o)),
        ("first genre", movielens.first_genre_config),
    ):
        out = work / name.replace(" ", "_")
        paths = [f"data.{s}_dir={out / s}" for s in ("train", "calibration", "eval")]
        build(make(paths), str(work / "raw"), str(out))
        # Training reads the config as shipped (the build-only truth join aside), one rank, no workers.
        variants[name] = (make(paths + ["data.num_workers=0"]), out)
    ms = {name: [] for name in variants}
    for r in range(args.repeats):
        for name, (cfg, _) in variants.items():
            ms[name].append(
                harness.one_rank_step_ms(cfg, work / "runs" / f"{name.replace(' ', '_')}-{r}", WARMUP, args.steps)
            )
    ratio = statistics.median(b / f for b, f in zip(ms["bags"], ms["first genre"]))
    mb = {
        name: sum(f.stat().st_size for f in (out / "train").glob("*.parquet")) / 2**20
        for name, (_, out) in variants.items()
    }
    print(f"MovieLens-shaped, {args.users} users; ms per training step (forward + backward + optimizer), one rank:")
    for name, values in ms.items():
        print(f"  {name:12s} " + "  ".join(f"{v:7.2f}" for v in values) + f"   train files {mb[name]:.2f} MiB")
    files = mb["bags"] / mb["first genre"]
    print(f"bags / first genre: {ratio:.3f}x step time (median of {args.repeats}), {files:.3f}x files")
    return {"ms": ms, "ratio": ratio, "mib": mb}


if __name__ == "__main__":
    main()
