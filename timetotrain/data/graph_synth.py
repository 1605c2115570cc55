"""A synthetic IGBH-like graph in the public IGBH layout (`ttt data synth-graph`), deterministic per seed.

No IGBH sample is reachable offline, so this is how the loader, the sampler and the tiny tier are fed.
What makes it learnable but not trivial (every knob is a `Scale` field):
- every node of every type has a latent class; paper labels are the papers' classes, drawn from a skewed
  prior (p_c proportional to (c+1)^-`class_skew`);
- features are `signal` x a class centroid + unit Gaussian noise, so features alone classify poorly;
- every relation links a node to a node of the same class with probability `homophily` (else to any
  node), so aggregating neighbours recovers the class;
- destinations are picked in proportion to Pareto(`popularity`) weights and citation counts per paper
  are Zipf(`cites_zipf`) draws, so in-degrees and out-degrees follow power laws with hubs, as in IGBH;
- only the first `labeled_fraction` of the papers carry labels, as only 157,675,969 of IGBH-full's
  269,346,174 papers do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from timetotrain import fileio
from timetotrain.data import npy
from timetotrain.data.igbh import (
    FEAT_FILE,
    LABEL_FILE,
    MANIFEST,
    NODE_TYPES,
    RELATIONS,
    Graph,
    coo_to_csc,
    directed,
    rel_dir,
)
from timetotrain.data.manifest import write_manifest
from timetotrain.errors import UserError


@dataclass(frozen=True)
class Scale:
    papers: int
    authors: int
    institutes: int
    fos: int
    journals: int
    conferences: int
    dim: int
    classes: int
    labeled_fraction: float = 0.6
    signal: float = 0.25  # centroid scale against unit noise
    homophily: float = 0.75  # chance an edge joins two nodes of one class
    class_skew: float = 0.5
    popularity: float = 1.5  # Pareto shape of the destination weights (smaller: heavier hubs)
    cites_zipf: float = 2.2  # Zipf exponent of citations per paper (plus one)
    max_cites: int = 200
    authors_per_paper: float = 2.5  # mean (1 + geometric)
    fos_per_paper: float = 1.8  # mean (1 + geometric)
    journal_fraction: float = 0.55  # papers published in a journal
    conference_fraction: float = 0.3  # papers presented at a conference


SCALES = {
    "tiny": Scale(papers=50_000, authors=40_000, institutes=1_000, fos=2_000, journals=500, conferences=300,
                  dim=64, classes=20),
    "small": Scale(papers=400_000, authors=300_000, institutes=5_000, fos=10_000, journals=2_000,
                   conferences=1_000, dim=128, classes=100),
}  # fmt: skip


def scale(name: str, **overrides) -> Scale:
    if name not in SCALES:
        raise UserError(f"--scale {name!r} is unknown: choose one of {', '.join(SCALES)}")
    return dataclasses.replace(SCALES[name], **overrides)


def scaled(sc: Scale, factor: float, **overrides) -> Scale:
    """`sc` with every node count times `factor` (at least 8 of each type)."""
    counts = ("papers", "authors", "institutes", "fos", "journals", "conferences")
    sizes = {k: max(8, round(getattr(sc, k) * factor)) for k in counts}
    return dataclasses.replace(sc, **sizes, **overrides)


def _pick(rng, target_class, weight, query_class, homophily):
    """One destination per query: of the query's class with probability `homophily`, else of any class,
    in proportion to `weight` (inverse CDF over the class-sorted cumulative weights; no per-node loop)."""
    order = np.argsort(target_class, kind="stable")
    cw = np.cumsum(weight[order])
    classes = int(max(target_class.max(), query_class.max())) + 1
    ends = cw[np.searchsorted(target_class[order], np.arange(classes), side="right") - 1]
    counts = np.bincount(target_class, minlength=classes)
    ends = np.where(counts > 0, ends, 0.0)
    starts = np.concatenate([[0.0], cw])[np.searchsorted(target_class[order], np.arange(classes))]
    same = rng.random(len(query_class)) < homophily
    same &= counts[query_class] > 0
    lo = np.where(same, starts[query_class], 0.0)
    hi = np.where(same, ends[query_class], cw[-1])
    u = lo + rng.random(len(query_class)) * (hi - lo)
    return order[np.minimum(np.searchsorted(cw, u, side="right"), len(cw) - 1)]


def _edges(rng, n_src, src_class, n_per_src, dst_class, dst_weight, homophily, drop_self=False):
    src = np.repeat(np.arange(n_src), n_per_src)
    dst = _pick(rng, dst_class, dst_weight, src_class[src], homophily)
    keep = src != dst if drop_self else np.ones(len(src), bool)
    pairs = np.unique(src[keep].astype(np.int64) * len(dst_class) + dst[keep])  # no duplicate edges
    return np.stack(np.divmod(pairs, len(dst_class)), axis=1).astype(np.int64)


def make(sc: Scale, seed: int):
    """The graph as arrays: (features per type, labels of the labeled papers, edges per on-disk relation)."""
    rng = np.random.default_rng(seed)
    counts = dict(zip(NODE_TYPES, (sc.papers, sc.authors, sc.institutes, sc.fos, sc.journals, sc.conferences),
                      strict=True))  # fmt: skip
    prior = (np.arange(sc.classes) + 1.0) ** -sc.class_skew
    prior /= prior.sum()
    cls = {t: rng.choice(sc.classes, n, p=prior) for t, n in counts.items()}
    weight = {t: rng.pareto(sc.popularity, n) + 1.0 for t, n in counts.items()}
    centroids = rng.standard_normal((sc.classes, sc.dim))
    feats = {
        t: (sc.signal * centroids[cls[t]] + rng.standard_normal((counts[t], sc.dim))).astype(np.float32)
        for t in NODE_TYPES
    }
    labels = cls["paper"][: int(sc.labeled_fraction * sc.papers)].astype(np.int64)

    def geometric(mean, n):
        return rng.geometric(1.0 / mean, n)  # >= 1, with this mean

    p = sc.papers
    plan = {
        ("paper", "cites", "paper"): (np.minimum(rng.zipf(sc.cites_zipf, p), sc.max_cites), True),
        ("paper", "written_by", "author"): (geometric(sc.authors_per_paper, p), False),
        ("author", "affiliated_to", "institute"): (1 + (rng.random(sc.authors) < 0.2), False),
        ("paper", "topic", "fos"): (geometric(sc.fos_per_paper, p), False),
        ("paper", "published", "journal"): ((rng.random(p) < sc.journal_fraction).astype(int), False),
        ("paper", "venue", "conference"): ((rng.random(p) < sc.conference_fraction).astype(int), False),
    }
    edges = {
        (s, rel, d): _edges(rng, counts[s], cls[s], per_src, cls[d], weight[d], sc.homophily, drop_self)
        for (s, rel, d), (per_src, drop_self) in plan.items()
    }
    return feats, labels, edges


def generate(out: Path, sc: Scale, seed: int, log=print) -> dict:
    """Write the graph under `out` (the `processed` layout); returns a summary of node and edge counts."""
    feats, labels, edges = make(sc, seed)
    out = Path(out)
    summary = {"nodes": {t: len(f) for t, f in feats.items()}, "edges": {}, "labeled": len(labels),
               "dim": sc.dim, "classes": sc.classes}  # fmt: skip
    # Every file appears at once, or none (an interrupted generation leaves no half graph).
    with fileio.Staged() as staged:
        written: list[Path] = []

        def save(path: Path, arr: np.ndarray) -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with staged.open(path) as f:  # a file object: np.save adds no second .npy
                npy.save(f, arr)
            written.append(path)

        for t, f in feats.items():
            save(out / t / FEAT_FILE, f)
        save(out / "paper" / LABEL_FILE, labels)
        for rel, e in edges.items():
            save(out / rel_dir(rel) / "edge_index.npy", e)
            summary["edges"][rel[1]] = len(e)
            log(f"{rel_dir(rel)}: {len(e):,} edges")
        # Sizes and sha256s of every file, checked by a run's preflight (`NodeClassification.resolve`).
        info = {"generator": {"scale": dataclasses.asdict(sc), "seed": seed}, **summary}
        write_manifest(out, MANIFEST, written, info, staged)
    return summary


def in_memory(sc: Scale, seed: int) -> Graph:
    """The same graph, never written: CSC built in memory (`ttt synth`, the warm-up before the clock)."""
    feats, labels, edges = make(sc, seed)
    n = {t: len(f) for t, f in feats.items()}
    csc = {}
    for (s, rel, d), e in edges.items():
        for r, a, b in directed((s, rel, d), e[:, 0], e[:, 1]):
            indptr, indices = coo_to_csc(a, b, n[r[0]], n[r[2]])
            csc[r] = (torch.from_numpy(indptr), torch.from_numpy(indices))
    csc = {r: csc[r] for r in RELATIONS}
    return Graph(n, feats, torch.from_numpy(labels), csc)
