"""What a history design costs: MovieLens configs that differ only in their history groups, side by
side on the same MovieLens-shaped files (docs/datasets.md, "Designing history groups").

    python benchmarks/history_designs.py [CONFIG ...] [--avoided-genres N] [--users 943] [--steps 40]
        [--repeats 3] [--work DIR]

Generates the files (``pinads_rec.data.shaped_logs.movielens``), builds them with each config
(``config_with_truth``: the truth joined for the build only), then times plain training steps of
each on one rank (``harness.measure_training``: forward, backward, optimizer; after a warm-up), the
configs alternating ``--repeats`` times so that a busy machine slows them alike. Prints per config
the ms per step of each repeat, the median ratio to the first config, the events per request (the
groups' mean lengths on the training split, summed) and the training files' size. The AUCs come
from ``benchmarks/datasets.py --config``; this measures what the designs cost.
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
DESIGNS = [
    "configs/datasets/movielens_100k_likes.yaml",  # the likes only
    "configs/datasets/movielens_100k.yaml",  # the likes, and every rating with its action
    "configs/datasets/movielens_100k_rated.yaml",  # every rating with its action, one group
    "configs/datasets/movielens_100k_disliked.yaml",  # the likes, and the dislikes apart
]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "configs", nargs="*", default=DESIGNS, help="configs of the MovieLens files (default: the four designs)"
    )
    p.add_argument("--avoided-genres", type=int, default=0, help="the generator's option (default 0: none)")
    p.add_argument("--users", type=int, default=943)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    args = p.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="history_designs_"))
    movielens.write(work / "raw", users=args.users, avoided=args.avoided_genres)
    variants = {}
    for path in args.configs:
        name = Path(path).stem
        out = work / name
        paths = [f"data.{s}_dir={out / s}" for s in ("train", "calibration", "eval")]
        built = build(config_with_truth("movielens", paths, path), str(work / "raw"), str(out))
        # The mean events per training request, all groups together (the build's summary).
        events = sum(g["mean"] for g in built["splits"]["train"]["sequence_lengths"].values())
        # Training reads the config as shipped (the build-only truth join aside), one rank, no workers.
        variants[name] = (config_with_truth("movielens", paths + ["data.num_workers=0"], path), out, events)
    ms = {name: [] for name in variants}
    for r in range(args.repeats):
        for name, (cfg, _, _) in variants.items():
            ms[name].append(harness.one_rank_step_ms(cfg, work / "runs" / f"{name}-{r}", WARMUP, args.steps))
    first = next(iter(variants))
    print(
        f"MovieLens-shaped, {args.users} users, avoided genres {args.avoided_genres}; ms per training step "
        "(forward + backward + optimizer), one rank:"
    )
    result = {}
    for name, (_, out, events) in variants.items():
        ratio = statistics.median(v / b for v, b in zip(ms[name], ms[first]))
        mib = sum(f.stat().st_size for f in (out / "train").glob("*.parquet")) / 2**20
        result[name] = {"ms": ms[name], "ratio": ratio, "mib": mib, "events_per_request": events}
        print(
            f"  {name:26s} "
            + "  ".join(f"{v:7.2f}" for v in ms[name])
            + f"   x{ratio:.2f}   events/request {events:5.1f}   train files {mib:.2f} MiB"
        )
    return result


if __name__ == "__main__":
    main()
