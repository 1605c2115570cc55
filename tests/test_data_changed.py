"""Training data truncated or rewritten in place under a live run, for every reader the timed part maps:
C4 windows (llama31_8b, gpt_oss_20b, deepseekv3_671b; llama31_405b's blend), flux1's encodings, rgat's node
features and llama2_70b_lora's GovReport blocks. Each reader notices before it touches the mapped pages (a
page beyond the new end of a file is a SIGBUS, which kills the run with no log line), and says so in one line
that does not tell the user to write over the file again. A file replaced by a rename is not a change.
tests/test_faults.py does the same for llama31_8b's C4 under a real subprocess."""

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from timetotrain.data.mapped import DataChangedError, MappedFiles
from timetotrain.errors import UserError
from timetotrain.spec.task import Share

pytestmark = pytest.mark.e2e

CPU = torch.device("cpu")
CHANGED = r"was (truncated|modified) while this run was reading it"


def cut(path: Path) -> None:
    """Truncate in place, as `cp` over the file or a filling disk does: the run has this inode mapped."""
    os.truncate(path, path.stat().st_size // 2)


def rewrite(path: Path) -> None:
    """New bytes, same size, in place (the mtime moved on, as a coarse-clock file system may not show)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size - 2)
        f.write(b"\x01\x02")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def assert_changed(exc: pytest.ExceptionInfo, path: Path) -> None:
    msg = str(exc.value)
    assert str(path) in msg and re.search(CHANGED, msg) and "\n" not in msg, msg
    assert "never write over data a run is using" in msg  # the fix is a new folder, never an overwrite


# -- the mapped .npy files themselves --


def test_mapped_npy_equals_np_load_and_ignores_a_rename(tmp_path):
    p = tmp_path / "a.npy"
    want = np.arange(3 * 4096, dtype=np.int32).reshape(3, 4096)
    np.save(p, want)
    m = MappedFiles()
    a = m.load(p)
    assert isinstance(a, np.memmap) and a.dtype == want.dtype and np.array_equal(a, want)
    np.save(tmp_path / "b.npy", want[:1])
    os.replace(tmp_path / "b.npy", p)  # what every ttt writer does: the map keeps the old inode
    m.check_unchanged()
    assert np.array_equal(a, want)
    np.save(tmp_path / "f.npy", np.asfortranarray(want))
    f = m.load(tmp_path / "f.npy")
    assert np.array_equal(f, want) and f.flags.f_contiguous
    np.save(tmp_path / "e.npy", np.zeros((0, 7), np.float32))
    assert m.load(tmp_path / "e.npy").shape == (0, 7)
    m.close()


@pytest.mark.parametrize("change", [cut, rewrite])
def test_mapped_npy_flags_a_change_in_place(tmp_path, change):
    p = tmp_path / "a.npy"
    np.save(p, np.arange(1 << 16, dtype=np.int64))
    m = MappedFiles()
    m.load(p)
    m.check_unchanged()
    change(p)
    with pytest.raises(DataChangedError) as e:
        m.check_unchanged()
    assert_changed(e, p)
    assert isinstance(e.value, UserError)  # the CLI's one line, exit 2


@pytest.mark.parametrize(
    "write,needle",
    [
        (lambda p: p.write_bytes(b"not an array"), "is not a readable .npy file"),
        (lambda p: p.write_bytes(b""), "is not a readable .npy file"),
        (lambda p: (np.save(p, np.arange(100)), os.truncate(p, 200)), "is truncated (200 bytes"),
        (lambda p: np.save(p, np.array([{}, []], dtype=object)), "holds Python objects"),
        (lambda p: None, "cannot be read (No such file or directory)"),
    ],
    ids=["not-npy", "empty", "short", "objects", "missing"],
)
def test_a_bad_npy_is_one_line_naming_it(tmp_path, write, needle):
    p = tmp_path / "x.npy"
    write(p)
    with pytest.raises(UserError) as e:
        MappedFiles().load(p)
    assert str(p) in str(e.value) and needle in str(e.value) and "\n" not in str(e.value)


# -- every reader of the timed part --


def test_c4_windows_and_the_405b_blend(tmp_path):
    from timetotrain.data.blend import BlendedWindows
    from timetotrain.data.gpt_dataset import GPTWindows
    from timetotrain.data.indexed import IndexedDataset, IndexedWriter
    from timetotrain.data.loader import TokenSource

    parts = []
    for name in ("en_6", "en_7"):
        with IndexedWriter(tmp_path / name) as w:
            for d in range(40):
                w.add_document(list(range(d, d + 300)))
        parts.append(GPTWindows(IndexedDataset(tmp_path / name), 16, 64, seed=1, shuffle=True))
    source = TokenSource(BlendedWindows(parts, [0.5, 0.5], 64), gbs=8, table=None)
    assert source.batch(0).shape == (8, 17)
    cut(tmp_path / "en_7.bin")
    with pytest.raises(UserError) as e:
        source.batch(1)
    assert str(tmp_path / "en_7.bin") in str(e.value) and re.search(CHANGED, str(e.value))
    assert "never write over data a run is using" in str(e.value)


def test_c4_windows_cut_between_the_check_and_the_reads_is_one_line_not_a_sigbus(tmp_path):
    # The race the check before each batch cannot close: the file cut after the check, before the reads.
    # GPTWindows reads through pread (IndexedDataset.read), so it is a short read and one line; through
    # the map it was a SIGBUS (tests/test_faults.py's live run died of one, -7, once in a CI run). In a
    # child process: a SIGBUS would take the test process with it.
    import subprocess
    import sys

    from timetotrain.data.indexed import IndexedWriter

    with IndexedWriter(tmp_path / "c4") as w:
        for d in range(40):
            w.add_document(list(range(d, d + 300)))
    code = f"""
import os
from timetotrain.data.gpt_dataset import GPTWindows
from timetotrain.data.indexed import IndexedDataError, IndexedDataset
ds = IndexedDataset({str(tmp_path / "c4")!r})
windows = GPTWindows(ds, 16, 64, seed=1, shuffle=True)
windows.batch(range(8))
ds.check_unchanged = lambda: None  # the check passed, then the cut: only the reads can notice
os.truncate({str(tmp_path / "c4.bin")!r}, 64)
try:
    windows.batch(range(8, 16))
except IndexedDataError as e:  # the loader turns it into the run's one line (data/loader.py)
    print(e)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])  # -7: SIGBUS
    assert "c4.bin ended early while this run was reading it" in proc.stdout, proc.stdout


def test_flux1_encodings(tmp_path):
    from test_flux_task import CFG, open_data, tier_for, write_dataset

    write_dataset(tmp_path, CFG, n_train=24, n_val=10)
    data = open_data(tmp_path, tier_for(CFG))
    data.batch(0)
    data.eval_chunk(0)
    rewrite(tmp_path / "validation" / "clip.npy")
    data.batch(1)  # the training files are as they were
    with pytest.raises(DataChangedError) as e:
        data.eval_chunk(0)
    assert_changed(e, tmp_path / "validation" / "clip.npy")
    cut(tmp_path / "train" / "vae_mean.npy")
    with pytest.raises(DataChangedError) as e:
        data.batch(2)
    assert_changed(e, tmp_path / "train" / "vae_mean.npy")


def test_rgat_node_features(tmp_path):
    from test_igbh import SCALE

    from timetotrain.data import graph_synth, igbh
    from timetotrain.tasks.node_classification import GraphData, _Seeds

    graph_synth.generate(tmp_path, SCALE, seed=3, log=lambda s: None)
    files = igbh.check_layout(tmp_path)
    igbh.build_csc(files, log=lambda s: None)
    graph = igbh.open_graph(files)
    train, val = igbh.split(len(graph.labels))
    data = _Seeds(graph, train, val, GraphData(), gbs=8, share=Share.of(8), seed=0, device=CPU)
    data.batch(0)
    feats = tmp_path / "author" / igbh.FEAT_FILE
    cut(feats)
    with pytest.raises(DataChangedError) as e:
        data.batch(1)
    assert_changed(e, feats)


def test_llama2_70b_lora_blocks(tmp_path):
    from test_llama2_70b_lora import BENCH, small_tier

    from timetotrain.data import govreport
    from timetotrain.tasks.lora_sft import _Resolved

    rng = np.random.default_rng(0)
    for split, n in (("train", 9), ("validation", 2)):
        ids = rng.integers(0, 32_000, (n, 32))
        govreport._save(tmp_path, split, ids, ids, {"tokenizer": {"name": "llama2"}})
    data = BENCH.task.open(
        small_tier(),
        _Resolved(tmp_path, None),
        seed=0,
        share=Share.of(small_tier().global_batch_size),
        device=CPU,
    )
    data.batch(0)
    ids_file = tmp_path / govreport.array_names("train")[0]
    rewrite(ids_file)
    with pytest.raises(DataChangedError) as e:
        data.batch(1)
    assert_changed(e, ids_file)


# -- a live run: run_stop aborted, one line, and the log was .partial while the run was live --


@pytest.mark.slow
def test_flux1_run_aborts_when_its_encodings_are_cut(tmp_path, monkeypatch, capsys):
    from test_flux_task import write_dataset

    from timetotrain.cli import main
    from timetotrain.spec.registry import get
    from timetotrain.tasks import rectified_flow

    tiny = get("flux1").tier("tiny")
    data, logs = tmp_path / "enc", tmp_path / "logs"
    write_dataset(data, tiny.model, n_train=tiny.data.train_samples, n_val=51)
    folder = logs / "flux1" / "tiny"
    real, live = rectified_flow._FlowData.batch, []

    def batch(self, step):
        if step == 3:  # the prefetch thread, while steps 1-2 train
            live.append(sorted(p.name for p in folder.iterdir()))
            cut(data / "train" / "t5.npy")
        return real(self, step)

    monkeypatch.setattr(rectified_flow._FlowData, "batch", batch)
    argv = [
        "run",
        "flux1",
        "--tier",
        "tiny",
        "--data",
        str(data),
        "--logdir",
        str(logs),
        "--seed",
        "1",
        "--quiet",
    ]
    code = main([*argv, "--max-steps", "8"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("ttt:")]
    assert len(lines) == 1 and f"{data / 'train' / 't5.npy'} was truncated while this run" in lines[0], err
    assert live == [["result_0.txt.partial"]]  # live: never under the final name
    assert sorted(p.name for p in folder.iterdir()) == ["result_0.txt"]  # run_stop written, then renamed
    last = [ln for ln in (folder / "result_0.txt").read_text().splitlines() if ":::MLLOG" in ln][-1]
    assert '"run_stop"' in last and '"status": "aborted"' in last
