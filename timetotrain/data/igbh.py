"""IGB-Heterogeneous on disk: the public `processed/` layout, its preflight, CSC per relation and the split.

The layout (IGB's `IGBHeteroDataset`, and the MLPerf rgat reference that reads it):
  paper/node_feat.npy                 [n_paper, dim] float32 (fp16 allowed)
  paper/node_label_2K.npy             [n_labeled] class ids of the first n_labeled papers
  <type>/node_feat.npy                for author, institute, fos, journal, conference
  <src>__<rel>__<dst>/edge_index.npy  [E, 2] int64: column 0 the source, column 1 the destination
Only six relations are on disk; the eleven the model uses are cites with a self-loop per paper made
symmetric plus each of the other five with its reverse (`rev_<rel>`), built here as the reference builds
them in memory.

The reference compresses COO to CSC once (`compress_graph.py`); the rules allow graph caching (not
feature caching), so the CSC arrays are built at preflight, off the clock, cached next to the data as
`ttt_csc/` and stamped with the sizes and mtimes of the files they came from and the cache's format (a
cache built by an older ttt is rebuilt, not read). The run memory-maps them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from timetotrain import fileio
from timetotrain.data import npy
from timetotrain.data.finite import check_finite
from timetotrain.data.manifest import read_manifest, verify_manifest
from timetotrain.data.mapped import MappedFiles
from timetotrain.errors import UserError

NODE_TYPES = ("paper", "author", "institute", "fos", "journal", "conference")
# The relations stored on disk, (source type, relation, destination type).
ON_DISK = (
    ("paper", "cites", "paper"),
    ("paper", "written_by", "author"),
    ("author", "affiliated_to", "institute"),
    ("paper", "topic", "fos"),
    ("paper", "published", "journal"),
    ("paper", "venue", "conference"),
)
# The eleven relations of the model: cites symmetric, then each other relation and its reverse.
RELATIONS = (ON_DISK[0],) + tuple(r for s, rel, d in ON_DISK[1:] for r in ((s, rel, d), (d, f"rev_{rel}", s)))
LABEL_FILE = "node_label_2K.npy"
FEAT_FILE = "node_feat.npy"
CACHE = "ttt_csc"
# Bumped whenever what the cache holds changes (2: cites self-loops and duplicate edges kept).
CACHE_FORMAT = 2
MANIFEST = "graph"  # graph.manifest.json: what `ttt data synth-graph` wrote, with sizes and sha256s
# The reference split (split_seeds.py): a torch seed-42 permutation of the labeled papers.
SPLIT_SEED = 42


def rel_dir(rel: tuple[str, str, str]) -> str:
    return "__".join(rel)


def rel_key(rel: tuple[str, str, str]) -> str:
    """A relation as one string, for batch dict keys and parameter names."""
    return "__".join(rel)


def find_root(data_dir: Path) -> Path:
    """The folder holding `paper/`: DIR itself, or DIR/full/processed as IGB's download unpacks."""
    for cand in (data_dir, data_dir / "full" / "processed", data_dir / "processed"):
        if (cand / "paper").is_dir():
            return cand
    raise UserError(
        f"--data {data_dir} holds no IGBH layout (paper/{FEAT_FILE}): point it at the `processed` folder, "
        "or write a synthetic graph with `ttt data synth-graph --scale tiny --out DIR`"
    )


# Into a new folder: a graph written over in place would be cut short under a run that maps it.
_REMEDY = "regenerate or re-download the graph into a new folder"


def _header(path: Path) -> np.ndarray:
    if not path.is_file():
        raise UserError(f"{path} is missing: the IGBH layout needs it ({_REMEDY})")
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise UserError(f"{path} is not a readable .npy file ({e}): {_REMEDY}") from e


@dataclass
class GraphFiles:
    """The checked layout: node counts, feature width, labeled papers, and where everything is."""

    root: Path
    num_nodes: dict[str, int]
    dim: int
    num_labeled: int

    def files(self) -> list[Path]:
        """What a run reads (the page cache drops these at `cache_clear`)."""
        out = [self.root / t / FEAT_FILE for t in NODE_TYPES] + [self.root / "paper" / LABEL_FILE]
        cache = self.root / CACHE
        return out + sorted(cache.glob("*.npy"))


def check_layout(data_dir: Path) -> GraphFiles:
    """Preflight of the layout: every file present, feature widths equal, label count within the papers.
    Edge indices are range-checked when the CSC cache is built (`build_csc`)."""
    root = find_root(Path(data_dir))
    counts, dims = {}, {}
    for t in NODE_TYPES:
        f = _header(root / t / FEAT_FILE)
        if f.ndim != 2 or f.dtype.kind != "f":
            raise UserError(
                f"{root / t / FEAT_FILE} has shape {f.shape} {f.dtype}: expected [num_{t}, dim] floats"
            )
        check_finite(root / t / FEAT_FILE, f, _REMEDY)
        counts[t], dims[t] = f.shape
    if len(set(dims.values())) != 1:
        raise UserError(
            f"{root}/*/{FEAT_FILE}: feature widths differ ({dims}): every node type needs the same width"
        )
    labels = _header(root / "paper" / LABEL_FILE)
    if labels.dtype.kind not in "iu":  # float labels would be cast to classes silently
        raise UserError(
            f"{root / 'paper' / LABEL_FILE} holds {labels.dtype} labels: expected integer class ids"
        )
    if labels.ndim != 1 or not 0 < len(labels) <= counts["paper"]:
        raise UserError(
            f"{root / 'paper' / LABEL_FILE} has shape {labels.shape}: expected [n] with 0 < n <= "
            f"{counts['paper']:,} papers (paper/{FEAT_FILE} rows)"
        )
    for rel in ON_DISK:
        e = _header(root / rel_dir(rel) / "edge_index.npy")
        if e.ndim != 2 or e.shape[1] != 2 or not np.issubdtype(e.dtype, np.integer):
            raise UserError(
                f"{root / rel_dir(rel) / 'edge_index.npy'} has shape {e.shape} {e.dtype}: expected [E, 2] integers"
            )
    return GraphFiles(root, counts, next(iter(dims.values())), len(labels))


def _stamp(root: Path) -> dict:
    files = [root / rel_dir(r) / "edge_index.npy" for r in ON_DISK] + [
        root / t / FEAT_FILE for t in NODE_TYPES
    ]
    stamp = {str(f.relative_to(root)): [f.stat().st_size, f.stat().st_mtime_ns] for f in files}
    return {**stamp, "ttt_csc_format": CACHE_FORMAT}


def coo_to_csc(src: np.ndarray, dst: np.ndarray, n_src: int, n_dst: int) -> tuple[np.ndarray, np.ndarray]:
    """CSC of one relation: for each destination its sources, sorted, duplicates kept. The reference's graph
    keeps them (GLT's `coo_to_csc` is a torch_sparse SparseTensor, sorted, never coalesced), its sampler
    draws CSC entries, so an edge stored twice is twice as likely to be drawn and counts twice in the
    softmax (docs/benchmarks/rgat.md, "Graph")."""
    key = np.sort(dst.astype(np.int64) * n_src + src)
    col, row = np.divmod(key, n_src)
    indptr = np.zeros(n_dst + 1, np.int64)
    np.cumsum(np.bincount(col, minlength=n_dst), out=indptr[1:])
    return indptr, row.astype(np.int32 if n_src < 2**31 else np.int64)


def cites_with_self_loops(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The reference's cites edges before it symmetrizes them (dataset.py and compress_graph.py:
    `add_self_loops(remove_self_loops(paper_paper_edges)[0])[0]`): self-citations dropped, then one loop
    per paper appended, for the papers 0..max id of the remaining edges (PyG's `maybe_num_nodes`, as no
    `num_nodes` is given)."""
    keep = src != dst
    src, dst = src[keep], dst[keep]
    n = int(max(src.max(), dst.max())) + 1 if len(src) else 0
    loops = np.arange(n, dtype=np.int64)
    return np.concatenate([src, loops]), np.concatenate([dst, loops])


def directed(rel, src: np.ndarray, dst: np.ndarray) -> list:
    """The model's relations from one stored relation, as (relation, sources, destinations): cites with
    the reference's self-loops made symmetric by appending every edge reversed (each loop so appears
    twice, as in the reference), any other relation and its reverse."""
    s, name, d = rel
    if name == "cites":
        a, b = cites_with_self_loops(np.asarray(src, np.int64), np.asarray(dst, np.int64))
        return [(rel, np.concatenate([a, b]), np.concatenate([b, a]))]
    return [(rel, src, dst), ((d, f"rev_{name}", s), dst, src)]


def verify(g: GraphFiles) -> bool:
    """Sizes, then sha256s, of the files the graph's manifest lists (`ttt data synth-graph` writes one; an
    IGBH download has none: its files were md5-checked by `ttt data download`). False when there is none."""
    doc = read_manifest(g.root, MANIFEST, tokenized=False, nested=True)
    if doc is None:
        return False
    verify_manifest(g.root, doc)
    return True


def _cached(cache: Path, stamp: dict) -> bool:
    """Whether the cache was built from these files and is whole: every array it lists at its size. A cache
    made from other files (or by an older version) is rebuilt; a damaged one is refused, since something
    other than ttt changed the folder."""
    try:
        meta = json.loads(
            fileio.read_bounded(cache / "stamp.json", fileio.SMALL_FILE, "cache stamp").decode()
        )
    except (OSError, ValueError):
        return False
    if not isinstance(meta, dict) or meta.get("sources") != stamp or not isinstance(meta.get("arrays"), dict):
        return False
    for name, size in meta["arrays"].items():
        path = cache / str(name)
        if Path(str(name)).name != name or not path.is_file() or path.stat().st_size != size:
            got = f"{path.stat().st_size:,} bytes" if path.is_file() else "missing"
            raise UserError(
                f"{path}: the graph cache is damaged ({got}, stamp.json says {size!r} bytes): delete {cache} "
                "and run again (it is rebuilt off the clock)"
            )
    return True


def build_csc(g: GraphFiles, log=print) -> float:
    """Build (or reuse) the CSC cache of the eleven relations; returns the seconds it took (0 if cached).
    An edge index outside its node type's range is a UserError naming the file."""
    cache = g.root / CACHE
    stamp = _stamp(g.root)
    meta = cache / "stamp.json"
    if _cached(cache, stamp):
        return 0.0
    t0 = time.monotonic()
    try:
        cache.mkdir(exist_ok=True)
    except OSError as e:
        raise UserError(f"{cache}: cannot write the graph cache ({e}): make the data folder writable") from e
    arrays: dict[str, int] = {}  # cache file -> bytes, so a truncated array is found at preflight
    with fileio.Staged() as staged:  # the arrays and their stamp appear together, the stamp last
        for s, rel, d in ON_DISK:
            path = g.root / rel_dir((s, rel, d)) / "edge_index.npy"
            e = np.load(path, mmap_mode="r", allow_pickle=False)
            src, dst = np.asarray(e[:, 0]), np.asarray(e[:, 1])
            for name, ids, t in (("source", src, s), ("destination", dst, d)):
                if len(ids) and (ids.min() < 0 or ids.max() >= g.num_nodes[t]):
                    bad = int(ids.max() if ids.max() >= g.num_nodes[t] else ids.min())
                    raise UserError(
                        f"{path}: {name} index {bad} is outside [0, {g.num_nodes[t]:,}) ({t}/{FEAT_FILE} "
                        "rows): the edges do not match the nodes"
                    )
            for r, a, b in directed((s, rel, d), src, dst):
                indptr, indices = coo_to_csc(a, b, g.num_nodes[r[0]], g.num_nodes[r[2]])
                for kind, arr in (("indptr", indptr), ("indices", indices)):
                    name = f"{rel_key(r)}.{kind}.npy"
                    with staged.open(cache / name) as f:
                        npy.save(f, arr)
                    arrays[name] = staged.current(cache / name).stat().st_size
            log(f"graph cache: {rel} ({len(src):,} edges) done")
        with staged.open(meta, "w") as f:
            json.dump({"sources": stamp, "arrays": arrays}, f)
    return time.monotonic() - t0


@dataclass
class Graph:
    """The graph of one run: memory-mapped features, labels, and CSC per relation (torch views)."""

    num_nodes: dict[str, int]
    feats: dict[str, np.ndarray]  # memory-mapped; gathered per batch, never cached
    labels: torch.Tensor  # [num_labeled] int64
    csc: dict[tuple[str, str, str], tuple[torch.Tensor, torch.Tensor]]  # (indptr, indices)
    # The files behind `feats` where they are mapped (None: in memory); checked before each gather.
    mapped: MappedFiles | None = None


def open_graph(g: GraphFiles) -> Graph:
    cache = g.root / CACHE
    mapped = MappedFiles()
    feats = {t: mapped.load(g.root / t / FEAT_FILE) for t in NODE_TYPES}
    labels = torch.from_numpy(
        np.asarray(np.load(g.root / "paper" / LABEL_FILE, allow_pickle=False), dtype=np.int64)
    )
    csc = {}
    for r in RELATIONS:
        indptr = torch.from_numpy(
            np.load(cache / f"{rel_key(r)}.indptr.npy", mmap_mode="r", allow_pickle=False).copy()
        )
        indices = torch.from_numpy(
            np.load(cache / f"{rel_key(r)}.indices.npy", mmap_mode="r", allow_pickle=False).copy()
        )
        csc[r] = (indptr, indices)  # int32 sources where they fit: half the memory of the reference's int64
    return Graph(dict(g.num_nodes), feats, labels, csc, mapped)


def split(num_labeled: int, train_fraction: float = 0.6, val_fraction: float = 0.005):
    """The reference split: a torch permutation of the labeled papers from seed 42; the first 60% train,
    the next 0.5% validation (int() of each fraction, as split_seeds.py truncates)."""
    perm = torch.randperm(num_labeled, generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_train, n_val = split_sizes(num_labeled, train_fraction, val_fraction)
    return perm[:n_train], perm[n_train : n_train + n_val]


def split_sizes(
    num_labeled: int, train_fraction: float = 0.6, val_fraction: float = 0.005
) -> tuple[int, int]:
    return int(train_fraction * num_labeled), int(val_fraction * num_labeled)


def gather_features(feats: np.ndarray, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a memory-mapped feature file, read in ascending order (sequential pages) and put back
    in the order asked, as fp32."""
    idx = ids.numpy()
    order = np.argsort(idx, kind="stable")
    out = np.empty((len(idx), feats.shape[1]), np.float32)
    out[order] = feats[idx[order]]
    return torch.from_numpy(out)
