"""Small raw files in the exact shape of the public datasets that configs/datasets/ read, with a
planted signal a model can learn, written in well under a second.

- ``write_taobao``: Taobao "Ad Display/Click Data" -- raw_sample.csv, ad_feature.csv (NULL brands),
  user_profile.csv (the header's trailing space, blank values, users missing) and behavior_log.csv
  (unsorted). Planted: a click is likely when the ad's category is among the categories of the
  user's last ``RECENT`` behaviour events before the impression (users' interests drift mid-way, so
  only the recent past tells), and when it is one of a few "hot" categories.
- ``write_kuairand``: KuaiRand -- log_standard_*.csv and log_random_*.csv (times in milliseconds,
  the random exposures with is_rand = 1), user_features_*.csv, video_features_basic_*.csv (blank
  tags, a video missing). Planted: a click is likely when the video is among the user's last
  ``RECENT`` clicked videos, or carries a "hot" tag, or the user is fully active.

Each also plants a probe user whose events sit at t - 1, t and t + 1 around its impressions, so a
test can state their sequences by hand (``TaobaoProbe`` / ``KuaiRandProbe`` hold the raw values).
Times are Beijing time (the datasets' own), as epoch seconds or milliseconds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Dict, List, Optional, Tuple
from zoneinfo import ZoneInfo

BEIJING = ZoneInfo("Asia/Shanghai")
RECENT = 10  # the planted signal looks at this many latest events (Taobao) or clicks (KuaiRand)
TAOBAO_PIDS = ("430548_1007", "430539_1007")


def beijing(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0) -> int:
    """Epoch seconds of a Beijing wall-clock time."""
    return int(datetime(year, month, day, hour, minute, second, tzinfo=BEIJING).timestamp())


def _field(value) -> str:
    if value is None:
        return ""  # a blank field
    text = str(value)
    return f'"{text}"' if "," in text else text  # "(0,10]", "12,65": quoted, as pandas writes them


def _csv(path: Path, header: str, rows) -> None:
    with open(path, "w") as f:
        f.write(header + "\n")
        for r in rows:
            f.write(",".join(_field(v) for v in r) + "\n")


def _sigmoid_draw(rng: random.Random, p: float) -> int:
    return int(rng.random() < p)


# --- Taobao ---------------------------------------------------------------------------------


@dataclass
class TaobaoProbe:
    """A user missing from user_profile.csv with hand-placed behaviour around two impressions: one
    request at ``time`` (placement 430548_1007, ads ``ads_first``) and one at ``time + 1``
    (430539_1007, ``ads_second``). ``events``: (time, btag, cate, brand or None)."""

    user: int
    time: int
    ads_first: List[int]
    ads_second: List[int]
    events: List[Tuple[int, str, int, Optional[int]]]


@dataclass
class TaobaoFixture:
    raw: Path
    probe: TaobaoProbe
    users_without_profile: List[int]
    ad_cate: Dict[int, int]  # adgroup_id -> cate_id (ads missing from ad_feature.csv left out)
    impressions: int = 0
    behaviour_events: int = 0
    blank_profile_users: List[int] = field(default_factory=list)  # a blank pvalue_level


def write_taobao(raw: Path, seed: int = 0, users: int = 600, requests_per_user: int = 9) -> TaobaoFixture:
    """Writes the four Taobao files into ``raw``; impressions on Beijing days 2017-05-06..05-13,
    behaviour 2017-04-22..05-13."""
    rng = random.Random(seed)
    raw.mkdir(parents=True, exist_ok=True)
    n_cates, n_brands, n_ads = 24, 72, 300
    cates = rng.sample(range(1, 12961), n_cates)
    brands = rng.sample(range(1, 461498), n_brands)
    brand_cate = {b: cates[i % n_cates] for i, b in enumerate(brands)}
    brands_of = {c: [b for b in brands if brand_cate[b] == c] for c in cates}
    ad_ids = rng.sample(range(1, 846812), n_ads)
    ads = {}
    for i, ad in enumerate(ad_ids):
        cate = cates[i % n_cates]
        brand = None if rng.random() < 0.15 else rng.choice(brands_of[cate])  # NULL brands, as in the real file
        ads[ad] = (
            cate,
            rng.randrange(1, 423437),
            rng.randrange(1, 255876),
            brand,
            round(rng.lognormvariate(4, 1.5), 2),
        )
    ads_of = {c: [a for a in ad_ids if ads[a][0] == c] for c in cates}
    hot = set(cates[-6:])  # categories clicked more by everyone
    missing_ads = ad_ids[:2]  # shown, but absent from ad_feature.csv

    user_ids = rng.sample(range(1, 1141729), users)
    probe_user = 1141729
    start, switch_lo, switch_hi = beijing(2017, 4, 22), beijing(2017, 5, 1), beijing(2017, 5, 10)
    imp_start, end = beijing(2017, 5, 6), beijing(2017, 5, 14)

    behaviour = []  # (user, time, btag, cate, brand)
    timeline: Dict[int, List[Tuple[int, int]]] = {}  # user -> [(time, cate)] sorted
    for u in user_ids:
        before, after = rng.sample(cates, 2), rng.sample(cates, 2)
        switch = rng.randrange(switch_lo, switch_hi)
        times = sorted(rng.sample(range(start, end), rng.randrange(25, 60)))  # distinct: no ties
        events = []
        for t in times:
            interest = before if t < switch else after
            cate = rng.choice(interest) if rng.random() < 0.8 else rng.choice(cates)
            brand = None if rng.random() < 0.03 else rng.choice(brands_of[cate])
            btag = rng.choices(["pv", "cart", "fav", "buy"], weights=[85, 6, 4, 5])[0]
            behaviour.append((u, t, btag, cate, brand))
            events.append((t, cate))
        timeline[u] = events

    probe_time = beijing(2017, 5, 9, 12, 0, 0)
    c = cates
    probe_events = [
        (probe_time - 7200, "fav", c[0], brands_of[c[0]][0]),
        (probe_time - 3600, "pv", c[1], None),
        (probe_time - 1, "cart", c[2], brands_of[c[2]][0]),  # t - 1: in both requests' sequences
        (probe_time, "buy", c[3], brands_of[c[3]][0]),  # t: only in the second request's (at t + 1)
        (probe_time + 1, "pv", c[4], brands_of[c[4]][0]),  # t + 1: in neither
    ]
    behaviour += [(probe_user, t, b, ca, br) for t, b, ca, br in probe_events]
    probe_first = [a for a in ad_ids[2:] if ads[a][0] == c[2]][:1] + [a for a in ad_ids[2:] if ads[a][0] == c[5]][:1]
    probe_second = [a for a in ad_ids[2:] if ads[a][0] == c[3]][:1]

    def recent_cates(u: int, t: int) -> set:
        events = [e for e in timeline[u] if e[0] < t]
        return {cate for _, cate in events[-RECENT:]}

    samples = []  # (user, time_stamp, adgroup_id, pid, nonclk, clk)
    for u in user_ids:
        seen = set()
        for _ in range(requests_per_user):
            t, pid = rng.randrange(imp_start, end), rng.choice(TAOBAO_PIDS)
            if (t, pid) in seen:
                continue
            seen.add((t, pid))
            recent = recent_cates(u, t)
            shown = set()
            for _ in range(rng.choices([1, 2, 3], weights=[5, 3, 2])[0]):
                if recent and rng.random() < 0.5:
                    ad = rng.choice(ads_of[rng.choice(sorted(recent))])
                else:
                    ad = rng.choice(ad_ids)
                if ad in shown:
                    continue
                shown.add(ad)
                cate = ads[ad][0]
                p = 0.02 + 0.45 * (cate in hot) + 0.3 * (cate in recent)
                p *= 1.0 if pid == TAOBAO_PIDS[0] else 0.8
                clk = _sigmoid_draw(rng, p)
                samples.append((u, t, ad, pid, 1 - clk, clk))
    samples += [(probe_user, probe_time, a, TAOBAO_PIDS[0], 1, 0) for a in probe_first]
    samples += [(probe_user, probe_time + 1, a, TAOBAO_PIDS[1], 0, 1) for a in probe_second]
    samples.append(samples[5])  # one impression logged twice: dropped and counted by the build
    rng.shuffle(samples)
    rng.shuffle(behaviour)  # behavior_log.csv is not sorted

    _csv(raw / "raw_sample.csv", "user,time_stamp,adgroup_id,pid,nonclk,clk", samples)
    _csv(
        raw / "ad_feature.csv",
        "adgroup_id,cate_id,campaign_id,customer,brand,price",
        [
            (a, *ads[a][:3], "NULL" if ads[a][3] is None else ads[a][3], ads[a][4])
            for a in ad_ids
            if a not in missing_ads
        ],
    )
    without_profile = user_ids[: users // 10]
    blank = []
    profile_rows = []
    for u in user_ids[users // 10 :]:
        pvalue = None if rng.random() < 0.3 else rng.randint(1, 3)
        if pvalue is None:
            blank.append(u)
        new_class = None if rng.random() < 0.25 else rng.randint(1, 4)
        profile_rows.append(
            (
                u,
                rng.randint(0, 96),
                rng.randint(0, 12),
                rng.randint(1, 2),
                rng.randint(0, 6),
                pvalue,
                rng.randint(1, 3),
                rng.randint(0, 1),
                new_class,
            )
        )
    rng.shuffle(profile_rows)
    _csv(
        raw / "user_profile.csv",
        # The real header ends with a space.
        "userid,cms_segid,cms_group_id,final_gender_code,age_level,pvalue_level,shopping_level,occupation,"
        "new_user_class_level ",
        profile_rows,
    )
    _csv(
        raw / "behavior_log.csv",
        "user,time_stamp,btag,cate,brand",
        [(u, t, b, ca, "NULL" if br is None else br) for u, t, b, ca, br in behaviour],
    )
    probe = TaobaoProbe(probe_user, probe_time, probe_first, probe_second, probe_events)
    ad_cate = {a: ads[a][0] for a in ad_ids if a not in missing_ads}
    return TaobaoFixture(raw, probe, without_profile + [probe_user], ad_cate, len(samples), len(behaviour), blank)


# --- KuaiRand -------------------------------------------------------------------------------

KUAIRAND_LOG_HEADER = (
    "user_id,video_id,date,hourmin,time_ms,is_click,is_like,is_follow,is_comment,is_forward,is_hate,long_view,"
    "play_time_ms,duration_ms,profile_stay_time,comment_stay_time,is_profile_enter,is_rand,tab"
)
KUAIRAND_USER_HEADER = (
    "user_id,user_active_degree,is_lowactive_period,is_live_streamer,is_video_author,follow_user_num,"
    "follow_user_num_range,fans_user_num,fans_user_num_range,friend_user_num,friend_user_num_range,register_days,"
    "register_days_range," + ",".join(f"onehot_feat{i}" for i in range(18))
)
KUAIRAND_VIDEO_HEADER = (
    "video_id,author_id,video_type,upload_dt,upload_type,visible_status,video_duration,server_width,server_height,"
    "music_id,music_type,tag"
)
HOT_TAGS = {3, 7, 11, 13, 17}
_ONEHOT_RANGES = [2, 7, 50, 1471, 15, 34, 3, 118, 454, 7, 5, 5, 2, 2, 2, 2, 2, 2]  # values 0..n-1


@dataclass
class KuaiRandProbe:
    """A user whose clicked impressions sit at ``time - 0.4 s``, ``time`` and ``time + 1 s`` (plus
    one an hour earlier and an unclicked one 10 s before), and a random exposure at ``time + 2 s``.
    ``rows``: (time_ms, video_id, tab, is_click, long_view, is_like, is_rand) of all its rows (no
    follow, comment or forward)."""

    user: int
    time: int
    rows: List[Tuple[int, int, int, int, int, int, int]]


@dataclass
class KuaiRandFixture:
    raw: Path
    probe: KuaiRandProbe
    standard_rows: int
    random_rows: int


def _kuairand_row(
    rng: random.Random, user, video, time_ms, click, long_view, like, is_rand, tab, duration_ms, rare: bool = True
):
    """One log row; ``rare``: draw the rare feedback (follow, comment, forward, hate), else all 0."""
    moment = datetime.fromtimestamp(time_ms / 1000, BEIJING)
    play = int(duration_ms * (rng.uniform(0.6, 1.5) if long_view else rng.uniform(0.0, 0.3)))
    follow = int(rare and click and rng.random() < 0.02)
    return (
        user,
        video,
        int(moment.strftime("%Y%m%d")),
        moment.hour * 100 + moment.minute,
        time_ms,
        click,
        like,
        follow,
        int(rare and click and rng.random() < 0.03),
        int(rare and click and rng.random() < 0.02),
        int(rare and rng.random() < 0.005),
        long_view,
        play,
        duration_ms,
        rng.randrange(0, 5000) if follow else 0,
        rng.randrange(0, 8000) if like else 0,
        follow,
        is_rand,
        tab,
    )


def write_kuairand(raw: Path, seed: int = 0, users: int = 300, impressions_per_user: int = 24) -> KuaiRandFixture:
    """Writes KuaiRand-Pure-shaped files into ``raw``: standard logs 2022-04-08..05-08 (two files,
    split at 04-22 as released), the random-exposure log 04-22..05-08, user and video features."""
    rng = random.Random(seed)
    raw.mkdir(parents=True, exist_ok=True)
    videos = rng.sample(range(0, 10_000_000), 150)
    authors = rng.sample(range(0, 8_839_735), 60)
    video_info = {}
    for v in videos:
        tags = rng.sample(range(0, 20), rng.choice([1, 1, 2]))
        video_info[v] = {
            "author": rng.choice(authors),
            "type": "AD" if rng.random() < 0.05 else "NORMAL",
            "upload": f"2022-0{rng.randint(1, 3)}-{rng.randint(10, 28)}",
            "upload_type": rng.choice(["ShortImport", "LongImport", "Web", "PictureSet"]),
            "duration": rng.choice([6000, 12000, 17200, 25000, 60000, 104400]),
            "music_type": rng.choice([4, 9, 11, None]),
            "tags": tags,
        }

    user_ids = rng.sample(range(0, 27285), users)
    probe_user = 27285
    degree = {u: rng.choice(["high_active", "full_active", "middle_active", "UNKNOWN"]) for u in user_ids}
    degree[probe_user] = "middle_active"
    start, split, end = beijing(2022, 4, 8), beijing(2022, 4, 22), beijing(2022, 5, 9)

    def click_p(u, v, recent) -> float:
        logit = -2.6 + 2.4 * (v in recent) + 2.2 * bool(HOT_TAGS & set(video_info[v]["tags"]))
        logit += 0.8 * (degree[u] == "full_active")
        return 1 / (1 + pow(2.718281828, -logit))

    standard, random_rows = [], []
    for u in user_ids:
        moments = [(rng.randrange(start, end) * 1000 + rng.randrange(1000), 0) for _ in range(impressions_per_user)]
        moments += [(rng.randrange(split, end) * 1000 + rng.randrange(1000), 1) for _ in range(4)]
        clicked: List[int] = []
        for time_ms, is_rand in sorted(set(moments)):
            recent = set(clicked[-RECENT:])
            if is_rand:
                v = rng.choice(videos)  # the random policy: any video of the pool
            elif recent and rng.random() < 0.5:
                v = rng.choice(sorted(recent))
            else:
                v = rng.choice(videos)
            click = _sigmoid_draw(rng, click_p(u, v, recent))
            duration = video_info[v]["duration"]
            long_view = int(click and rng.random() < (0.8 if duration <= 18000 else 0.4))
            like = int(click and rng.random() < (0.3 if v in recent else 0.08))
            tab = rng.choices([1, 0, 2, 4], weights=[70, 15, 10, 5])[0]
            row = _kuairand_row(rng, u, v, time_ms, click, long_view, like, is_rand, tab, duration)
            (random_rows if is_rand else standard).append(row)
            if click:
                clicked.append(v)

    t = beijing(2022, 4, 25, 20, 30, 0)
    probe_plan = [  # time_ms, video, tab, click, long_view, like, is_rand
        (t * 1000 - 3_600_000, videos[1], 0, 1, 1, 1, 0),
        (t * 1000 - 10_000, videos[2], 1, 0, 0, 0, 0),  # not clicked: not in any history
        (t * 1000 - 400, videos[3], 1, 1, 0, 0, 0),  # t - 0.4 s: before the impression at t
        (t * 1000, videos[4], 1, 1, 1, 0, 0),  # t: the probe impression itself
        (t * 1000 + 1000, videos[5], 2, 1, 0, 1, 0),  # t + 1 s
        (t * 1000 + 2000, videos[6], 1, 0, 0, 0, 1),  # a random exposure (eval) at t + 2 s
    ]
    for time_ms, v, tab, click, lv, like, is_rand in probe_plan:
        duration = video_info[v]["duration"]
        row = _kuairand_row(rng, probe_user, v, time_ms, click, lv, like, is_rand, tab, duration, rare=False)
        (random_rows if is_rand else standard).append(row)

    standard.sort(key=lambda r: (r[0], r[4]))
    random_rows.sort(key=lambda r: (r[0], r[4]))
    _csv(raw / "log_standard_4_08_to_4_21_pure.csv", KUAIRAND_LOG_HEADER, [r for r in standard if r[4] < split * 1000])
    _csv(raw / "log_standard_4_22_to_5_08_pure.csv", KUAIRAND_LOG_HEADER, [r for r in standard if r[4] >= split * 1000])
    _csv(raw / "log_random_4_22_to_5_08_pure.csv", KUAIRAND_LOG_HEADER, random_rows)

    ranges = {
        "follow": ["0", "(0,10]", "(10,50]", "(50,100]", "500+"],
        "fans": ["0", "[1,10)", "[10,100)", "[100,1k)"],
        "friend": ["0", "[1,5)", "[5,30)"],
        "register": ["31-60", "181-365", "730+"],
    }
    user_rows = []
    for u in user_ids + [probe_user]:
        user_rows.append(
            (
                u,
                degree[u],
                rng.randint(0, 1),
                rng.randint(0, 1),
                rng.randint(0, 1),
                rng.randrange(0, 600),
                rng.choice(ranges["follow"]),
                rng.randrange(0, 900),
                rng.choice(ranges["fans"]),
                rng.randrange(0, 40),
                rng.choice(ranges["friend"]),
                rng.randrange(15, 3000),
                rng.choice(ranges["register"]),
                *[rng.randrange(n) for n in _ONEHOT_RANGES],
            )
        )
    _csv(raw / "user_features_pure.csv", KUAIRAND_USER_HEADER, user_rows)
    video_rows = []
    for v in videos[1:]:  # videos[0] is shown but absent from the file
        i = video_info[v]
        tag = None if rng.random() < 0.05 else ",".join(map(str, i["tags"]))  # blank tags occur
        video_rows.append(
            (
                v,
                i["author"],
                i["type"],
                i["upload"],
                i["upload_type"],
                1,
                float(i["duration"]),
                720,
                1280,
                rng.randrange(1, 10**9),
                i["music_type"],
                tag,
            )
        )
    _csv(raw / "video_features_basic_pure.csv", KUAIRAND_VIDEO_HEADER, video_rows)
    probe = KuaiRandProbe(probe_user, t, probe_plan)
    return KuaiRandFixture(raw, probe, len(standard), len(random_rows))
