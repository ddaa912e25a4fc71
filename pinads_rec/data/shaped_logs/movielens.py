"""Raw files in the exact layout of MovieLens-100K (``u.data``, ``u.item``, ``u.user``: no header
lines, tab and pipe delimited, ``u.item`` in Latin-1 with nineteen 0/1 genre columns), with a
planted truth kept aside in ``truth.csv`` (the true probability that each rating is a "like",
4 or 5 stars, keyed by ``user_id, item_id, timestamp``).

- **Movies** (1,682): one to four genres each, drawn by the real file's genre popularity (Drama
  and Comedy most, Film-Noir and Fantasy least); a quality; a release date.
- **Users** (943): age, gender, occupation, zip code as ``u.user`` has them; two **favourite
  genres**, drawn by popularity, so most often one a movie lists *after* another (Romance after
  Comedy or Drama, Thriller after Action or Crime): MovieLens lists a movie's genres in
  alphabetical order, and a history that keeps only the first genre of each movie misses them.
- **Ratings**: each user rates 20 to a few hundred movies over 1997-09-20 .. 1998-04-22, mostly in
  a few sessions; what they watch is half popular movies, half movies of their favourite genres.
  P(like) = sigmoid(base + quality + user bias + FAVOURITE x the number of the movie's genres among
  the user's favourites); a like is rated 4 or 5, the others 1 to 3.
- **Avoided genres** (``avoided > 0``; none by default): each user also has ``avoided`` genres
  they rate harshly, drawn by popularity among the others, and P(like) loses AVOID per one of
  them the movie lists. What they watch does not change (the popular half holds such movies), so
  only their low ratings show the avoidance: a history of likes sees it as an absence, a history
  of every rating with its like/dislike action sees it outright (docs/datasets.md, "Designing
  history groups"). A real ratings log has this: a user's dislikes say which genres they avoid.

``write`` returns (and saves as ``summary.json``) the counts and the oracle's AUC.
``first_genre_config`` is the MovieLens config with each history event's first genre instead of
its bag: what the bag is measured against (tests/test_movielens.py, benchmarks/event_bags.py).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, Sequence

import numpy as np
import pandas as pd

from pinads_rec.data.shaped_logs.common import auc, sigmoid

GENRES = [
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama",
    "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western",
]  # fmt: skip
# Movies per genre in the real u.item (1,682 movies), as draw weights.
GENRE_COUNTS = np.array([2, 251, 135, 42, 122, 505, 109, 50, 725, 22, 24, 92, 56, 61, 247, 101, 251, 71, 27], float)
OCCUPATIONS = ["administrator", "artist", "educator", "engineer", "librarian", "other", "programmer", "student"]
N_MOVIES = 1682
START = int(datetime(1997, 9, 20, tzinfo=timezone.utc).timestamp())
END = int(datetime(1998, 4, 23, tzinfo=timezone.utc).timestamp())
BASE, USER_SD, QUALITY_SD, FAVOURITE = -1.2, 0.5, 0.6, 1.6
AVOID = 1.6  # the like logit lost per avoided genre a movie lists (write(avoided=...))


def first_genre_config(overrides: Sequence[str] = ()):
    """``config_with_truth("movielens")`` with each history event's first genre (u.item's column
    order) as its genre, one id per event, instead of the bag of them, in every group."""
    from pinads_rec.data.shaped_logs import config_with_truth

    bags = config_with_truth("movielens", overrides)
    columns = {g.name: next(f.column for f in g.features if f.name == "genres") for g in bags.features.sequence_groups}
    one_id = [f"features.sequence_groups.{g}.features.genres.max_values=1" for g in columns]
    cfg = config_with_truth("movielens", list(overrides) + one_id)
    for source in cfg.build.sequences:
        column = columns[source.group]
        source.columns[column] = f"({source.columns[column]})[1]"
    return cfg


def write(raw: Path, users: int = 943, seed: int = 0, avoided: int = 0) -> Dict:
    """Writes u.data, u.item, u.user and truth.csv into ``raw``; returns the summary. ``avoided``:
    genres per user rated harshly (module docstring); 0 writes the files exactly as before."""
    rng = np.random.default_rng(seed)
    raw = Path(raw)
    raw.mkdir(parents=True, exist_ok=True)
    genre_p = GENRE_COUNTS / GENRE_COUNTS.sum()

    # --- movies: 1-4 genres (flags), quality ---
    n_genres = rng.choice([1, 2, 3, 4], N_MOVIES, p=[0.45, 0.35, 0.15, 0.05])
    flags = np.zeros((N_MOVIES, len(GENRES)), np.int64)
    for m in range(N_MOVIES):
        flags[m, rng.choice(len(GENRES), n_genres[m], replace=False, p=genre_p)] = 1
    quality = rng.normal(0.0, QUALITY_SD, N_MOVIES)
    popularity = np.exp(1.2 * quality) * rng.pareto(1.5, N_MOVIES)
    popular_p = popularity / popularity.sum()

    # --- users: demographics, bias, two favourite genres ---
    favourites = np.stack([rng.choice(len(GENRES), 2, replace=False, p=genre_p) for _ in range(users)])
    user_bias = rng.normal(0.0, USER_SD, users)
    n_ratings = np.minimum(20 + rng.geometric(1 / 80, users), 600)

    rows = []
    for u in range(users):
        n = int(n_ratings[u])
        liked_genre = flags[:, favourites[u]].any(1)
        fav_p = liked_genre / liked_genre.sum()
        p = 0.5 * popular_p + 0.5 * fav_p
        movies = rng.choice(N_MOVIES, min(n, N_MOVIES), replace=False, p=p)
        # A few sessions: ratings seconds to minutes apart within one, days apart between them.
        sessions = rng.integers(1, 5)
        starts = np.sort(rng.integers(START, END - 86400, sessions))
        session = np.sort(rng.integers(0, sessions, len(movies)))
        t = starts[session] + np.cumsum(rng.integers(5, 120, len(movies)))
        rows.append(pd.DataFrame({"u": u, "m": movies, "timestamp": np.minimum(t, END - 1)}))
    log = pd.concat(rows, ignore_index=True).sort_values(["u", "timestamp"], kind="stable")
    u, m = log.u.to_numpy(), log.m.to_numpy()
    matches = flags[m[:, None], favourites[u]].sum(1)
    logit = BASE + quality[m] + user_bias[u] + FAVOURITE * matches
    if avoided:
        # A stream of its own: the default files (avoided = 0) stay draw for draw as they were.
        avoid = _avoided_genres(np.random.default_rng([seed, 1]), favourites, avoided, genre_p)
        logit = logit - AVOID * flags[m[:, None], avoid[u]].sum(1)
    p_like = sigmoid(logit)
    like = rng.random(len(log)) < p_like
    rating = np.where(
        like, rng.choice([4, 5], len(log), p=[0.6, 0.4]), rng.choice([1, 2, 3], len(log), p=[0.2, 0.3, 0.5])
    )
    data = pd.DataFrame({"user_id": u + 1, "item_id": m + 1, "rating": rating, "timestamp": log.timestamp.to_numpy()})
    data.to_csv(raw / "u.data", sep="\t", header=False, index=False)
    pd.DataFrame(
        {"user_id": data.user_id, "item_id": data.item_id, "timestamp": data.timestamp, "p_like": np.round(p_like, 6)}
    ).to_csv(raw / "truth.csv", index=False)

    release = pd.to_datetime(rng.integers(-800_000_000, START, N_MOVIES), unit="s").strftime("%d-%b-%Y")
    items = pd.DataFrame(
        {
            "movie_id": np.arange(1, N_MOVIES + 1),
            "title": [f"Film {i} (199{i % 8})" for i in range(1, N_MOVIES + 1)],
            "release_date": release,
            "video_release_date": "",
            "url": [f"http://us.imdb.com/M/title-exact?Film%20{i}" for i in range(1, N_MOVIES + 1)],
        }
    )
    items.loc[0, "title"] = "Café Society (1995)"  # Latin-1 text, as the real file has
    for j, g in enumerate(GENRES):
        items[g] = flags[:, j]
    with open(raw / "u.item", "w", encoding="latin-1", newline="\n") as fh:
        items.to_csv(fh, sep="|", header=False, index=False)
    pd.DataFrame(
        {
            "user_id": np.arange(1, users + 1),
            "age": rng.integers(7, 74, users),
            "gender": rng.choice(["M", "F"], users, p=[0.71, 0.29]),
            "occupation": rng.choice(OCCUPATIONS, users),
            "zip": [f"{z:05d}" for z in rng.integers(1000, 99999, users)],
        }
    ).to_csv(raw / "u.user", sep="|", header=False, index=False)

    summary = {
        "users": users,
        **({"avoided_genres": avoided} if avoided else {}),
        "movies": N_MOVIES,
        "ratings": len(data),
        "like_rate": round(float(like.mean()), 4),
        "oracle_auc": round(auc(p_like, like), 4),
        "genres_per_movie": round(float(n_genres.mean()), 3),
        # How often a favourite genre is not the movie's first (alphabetical) genre, among the movies
        # holding one: what a history of first genres misses.
        "favourite_not_first_genre": round(float(_not_first(flags, favourites[u], m)), 4),
    }
    (raw / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _avoided_genres(rng: np.random.Generator, favourites: np.ndarray, k: int, genre_p: np.ndarray) -> np.ndarray:
    """[users, k] genres each user avoids: drawn by popularity, never one of their favourites."""
    out = np.empty((len(favourites), k), np.int64)
    for u, fav in enumerate(favourites):
        p = genre_p.copy()
        p[fav] = 0.0
        out[u] = rng.choice(len(p), k, replace=False, p=p / p.sum())
    return out


def _not_first(flags: np.ndarray, favourites: np.ndarray, movies: np.ndarray) -> float:
    first = flags[movies].argmax(1)  # the first flag set: the genre listed first
    holds = flags[movies[:, None], favourites].any(1)
    first_is_favourite = (first[:, None] == favourites).any(1)
    return ((holds & ~first_is_favourite).sum()) / max(holds.sum(), 1)
