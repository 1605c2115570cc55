"""The IGBH layout: the synthetic generator (deterministic, power-law, homophilous), the loader's CSC per
relation and seed-42 split, and the preflight's one-line errors naming the file."""

import dataclasses
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


def test_csc_holds_every_relation_with_reverses(graph):
    files = igbh.check_layout(graph)
    assert igbh.build_csc(files, log=lambda s: None) > 0
    assert igbh.build_csc(files, log=lambda s: None) == 0.0  # cached, stamped by the source files
    g = igbh.open_graph(files)
    assert len(g.csc) == 11
    for s, rel, d in igbh.ON_DISK:
        e = np.load(graph / igbh.rel_dir((s, rel, d)) / "edge_index.npy")
        stored = set(map(tuple, e.tolist()))
        for r, want in (
            [((s, rel, d), stored | {(b, a) for a, b in stored})]
            if rel == "cites"
            else [((s, rel, d), stored), ((d, f"rev_{rel}", s), {(b, a) for a, b in stored})]
        ):
            indptr, indices = g.csc[r]
            dst = torch.repeat_interleave(torch.arange(len(indptr) - 1), indptr[1:] - indptr[:-1])
            assert set(zip(indices.tolist(), dst.tolist(), strict=True)) == want, r


def test_split_is_the_references():
    assert igbh.split_sizes(157_675_969) == (94_605_581, 788_379)
    train, val = igbh.split(1000)
    torch.manual_seed(42)  # split_seeds.py: the global seed, then randperm
    perm = torch.randperm(1000)
    assert torch.equal(train, perm[:600]) and torch.equal(val, perm[600:605])


def _tiny_graph(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    graph_synth.generate(out, graph_synth.SCALES["tiny"], seed=0, log=lambda s: None)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _tiny_graph(tmp_path_factory)


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
