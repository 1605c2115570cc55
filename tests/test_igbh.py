"""The IGBH layout: the synthetic generator (deterministic, power-law, homophilous), the loader's CSC per
relation and seed-42 split, and the preflight's one-line errors naming the file."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch

from timetotrain.cli import main
from timetotrain.data import graph_synth, igbh
from timetotrain.errors import UserError
from timetotrain.suite import rgat as suite_rgat

SCALE = graph_synth.scaled(graph_synth.SCALES["tiny"], 0.1)


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    out = tmp_path_factory.mktemp("igbh")
    graph_synth.generate(out, SCALE, seed=3, log=lambda s: None)
    return out


def test_generator_is_deterministic_and_igbh_like(graph, tmp_path):
    graph_synth.generate(tmp_path, SCALE, seed=3, log=lambda s: None)
    files = sorted(p.relative_to(graph) for p in graph.rglob("*.npy") if igbh.CACHE not in p.parts)
    assert len(files) == 6 + 6 + 1  # features of six types, six stored relations, the labels
    for f in files:
        assert (graph / f).read_bytes() == (tmp_path / f).read_bytes(), f
    feats, labels, edges = graph_synth.make(SCALE, seed=4)
    assert not np.array_equal(labels, np.load(graph / "paper" / igbh.LABEL_FILE))
    cites = np.load(graph / "paper__cites__paper" / "edge_index.npy")
    assert cites.shape[1] == 2 and cites.dtype == np.int64
    lab = np.load(graph / "paper" / igbh.LABEL_FILE)
    assert len(lab) == int(SCALE.labeled_fraction * SCALE.papers)
    # Power law: hubs far above the mean in-degree; homophily: most citations stay within a class.
    indeg = np.bincount(cites[:, 1], minlength=SCALE.papers)
    assert indeg.max() > 15 * indeg.mean()
    both = (cites[:, 0] < len(lab)) & (cites[:, 1] < len(lab))
    same = (lab[cites[both, 0]] == lab[cites[both, 1]]).mean()
    assert 0.6 < same < 0.95  # learnable from neighbours, not a copy of the label
    # Features carry the class only weakly: a nearest-centroid guess on features alone is far from perfect.
    x = np.load(graph / "paper" / igbh.FEAT_FILE)[: len(lab)]
    cent = np.stack([x[lab == c].mean(0) for c in range(SCALE.classes)])
    acc = ((x @ cent.T - 0.5 * (cent**2).sum(1)).argmax(1) == lab).mean()
    assert 0.2 < acc < 0.8


def _csc_keys(indptr, indices) -> np.ndarray:
    """The CSC's (source, destination) entries as one sorted int64 each, duplicates kept."""
    dst = torch.repeat_interleave(torch.arange(len(indptr) - 1), indptr[1:] - indptr[:-1])
    return _keys(indices.long(), dst)


def _keys(src, dst) -> np.ndarray:
    return np.sort((dst.long() * 2**32 + src.long()).numpy())


def test_csc_holds_every_relation_as_the_reference_builds_it(graph, tmp_path):
    """Each relation's CSC is the multiset of edges the reference gives GLT (dataset.py, compress_graph.py),
    built here with PyG's own `remove_self_loops` / `add_self_loops`: cites gets a self-loop per paper, then
    every edge appended reversed, so a loop and a citation stored both ways are there twice (GLT's CSC
    keeps duplicates); every other relation is itself and its reverse. The stored cites gain a
    self-citation and a duplicate first, which the reference drops and keeps."""
    pyg = pytest.importorskip("torch_geometric.utils")
    graph = shutil.copytree(graph, tmp_path / "g", ignore=shutil.ignore_patterns(igbh.CACHE))
    path = graph / "paper__cites__paper" / "edge_index.npy"
    e = np.load(path)
    np.save(path, np.concatenate([e, [[7, 7], e[0]]]))
    files = igbh.check_layout(graph)
    assert igbh.build_csc(files, log=lambda s: None) > 0
    assert igbh.build_csc(files, log=lambda s: None) == 0.0  # cached, stamped by the source files
    g = igbh.open_graph(files)
    assert len(g.csc) == 11
    for s, rel, d in igbh.ON_DISK:
        e = torch.from_numpy(np.load(graph / igbh.rel_dir((s, rel, d)) / "edge_index.npy")).t()
        if rel == "cites":
            c = pyg.add_self_loops(pyg.remove_self_loops(e)[0])[0]
            ref = {(s, rel, d): (torch.cat([c[1], c[0]]), torch.cat([c[0], c[1]]))}
        else:
            ref = {(s, rel, d): (e[0], e[1]), (d, f"rev_{rel}", s): (e[1], e[0])}
        for r, (src, dst) in ref.items():
            assert np.array_equal(_csc_keys(*g.csc[r]), _keys(src, dst)), r
    indptr, indices = g.csc[igbh.ON_DISK[0]]
    for p in (0, 7):  # one loop per paper, appended twice
        assert (indices[indptr[p] : indptr[p + 1]] == p).sum() == 2


def test_an_old_cache_is_rebuilt(graph, tmp_path):
    """A cache written before the self-loops (another format stamp) is not read."""
    graph = shutil.copytree(graph, tmp_path / "g", ignore=shutil.ignore_patterns(igbh.CACHE))
    files = igbh.check_layout(graph)
    igbh.build_csc(files, log=lambda s: None)
    meta = graph / igbh.CACHE / "stamp.json"
    stamp = json.loads(meta.read_text())
    sources = {k: v for k, v in stamp["sources"].items() if k != "ttt_csc_format"}
    meta.write_text(json.dumps({**stamp, "sources": sources}))
    assert igbh.build_csc(files, log=lambda s: None) > 0


def test_split_is_the_references():
    assert igbh.split_sizes(157_675_969) == (94_605_581, 788_379)
    train, val = igbh.split(1000)
    torch.manual_seed(42)  # split_seeds.py: the global seed, then randperm
    perm = torch.randperm(1000)
    assert torch.equal(train, perm[:600]) and torch.equal(val, perm[600:605])


@pytest.fixture(scope="module")
def tiny(graph_tiny):
    return graph_tiny  # conftest's `ttt data synth-graph --scale tiny --seed 0`, shared with test_rgat_tiny


def _broken(src, tmp_path, how):
    bad = tmp_path / "bad"
    shutil.copytree(src, bad, ignore=shutil.ignore_patterns(igbh.CACHE))
    return how(bad)


def _missing_relation(d):
    shutil.rmtree(d / "paper__venue__conference")
    return "paper__venue__conference/edge_index.npy"


def _edge_out_of_range(d):
    e = np.load(d / "paper__topic__fos" / "edge_index.npy")
    e[5, 1] = graph_synth.SCALES["tiny"].fos + 3
    np.save(d / "paper__topic__fos" / "edge_index.npy", e)
    return "paper__topic__fos/edge_index.npy"


def _feature_rows(d):
    f = np.load(d / "author" / igbh.FEAT_FILE)
    np.save(d / "author" / igbh.FEAT_FILE, f[:-10])
    return "author/node_feat.npy"


def _label_out_of_range(d):
    # Checked in preflight, before run_start: once it was found only when the data opened after the
    # clock started, and the aborted run left a result file.
    y = np.load(d / "paper" / igbh.LABEL_FILE)
    y[7] = suite_rgat.TINY.model.classes
    np.save(d / "paper" / igbh.LABEL_FILE, y)
    return "paper/node_label_2K.npy"


@pytest.mark.parametrize("how", [_missing_relation, _edge_out_of_range, _feature_rows, _label_out_of_range])
def test_preflight_names_the_file(tiny, tmp_path, capsys, how):
    name = _broken(tiny, tmp_path, lambda d: (d, how(d)))
    bad, rel = name
    code = main(["run", "rgat", "--tier", "tiny", "--data", str(bad), "--logdir", str(tmp_path / "logs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and rel in err[0] and "Traceback" not in err[0], err
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").rglob("result_*.txt"))


def test_tier_data_matches_the_generator(tiny):
    tier = suite_rgat.TINY
    res = suite_rgat.BENCHMARK.task.resolve(tier, tiny)
    assert res.graph_files.num_labeled == tier.data.num_labeled
    wrong = dataclasses.replace(tier, model=dataclasses.replace(tier.model, in_dim=32))
    with pytest.raises(UserError, match="node_feat.npy has 64-d features"):
        suite_rgat.BENCHMARK.task.resolve(wrong, tiny)
