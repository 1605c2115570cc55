"""`ttt data download --for BENCH --tier reference`: the table's datasets fetched from a copy of MLCommons'
storage served on 127.0.0.1 (`--mirror`, the same metadata/ paths), each into its folder, md5-checked,
resumed after a cut; what no URL fetches, an unknown benchmark or tier, one line and nothing written."""

import hashlib
import shutil
from pathlib import Path

import pytest
from test_download import Server, errors

from timetotrain.cli import main as ttt
from timetotrain.data.reference_sources import REFERENCE

FLUX = REFERENCE["flux1"]


def bucket(root: Path, url: str, corrupt: str | None = None) -> dict[str, bytes]:
    """flux1's three datasets in the storage layout: metadata/<name>.uri naming files/<name>, and the .md5
    list beside it; two files each, one in a subfolder. Returns {folder/relative path: bytes}."""
    want = {}
    (root / "metadata").mkdir(parents=True)
    for i, f in enumerate(FLUX.fetch):
        files = {
            "data-00000-of-00001.arrow": bytes(range(256)) * (40 + i),
            "sub/state.json": b'{"n": %d}' % i,
        }
        lines = []
        for rel, data in files.items():
            path = root / "files" / f.name / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            lines.append(f"{hashlib.md5(data).hexdigest()}  ./{rel}")
            want[f"{f.folder}/{rel}"] = data
        (root / "metadata" / f"{f.name}.uri").write_text(f"{url}/files/{f.name}\n")
        (root / "metadata" / f"{f.name}.md5").write_text("\n".join(lines) + "\n")
    if corrupt is not None:
        path = root / "files" / corrupt
        path.write_bytes(path.read_bytes()[:-1] + b"!")
    return want


def download(out: Path, srv: Server, *extra: str) -> int:
    return ttt(["data", "download", "--for", "flux1", "--tier", "reference", "--mirror", srv.url,
                "--out", str(out), "--workers", "1", *extra])  # fmt: skip


def test_each_dataset_lands_in_its_folder_and_a_cut_resumes(tmp_path, capsys):
    srv = Server(tmp_path / "bucket", drop_after=100)  # every file's first response cut after 100 bytes
    try:
        want = bucket(tmp_path / "bucket", srv.url)
        out = tmp_path / "out"
        assert download(out, srv) == 0
    finally:
        srv.close()
    got = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert (
        got == want
    )  # the layout the importer reads: cc12m_preprocessed/, coco_preprocessed/, empty_encodings/
    assert (
        sorted(r for r in srv.ranges if r) == ["bytes=100-"] * 3
    )  # the 3 files over 100 bytes  # each resumed from where it was cut
    stdout = capsys.readouterr().out
    assert "6 file(s)" in stdout and "md5-checked" in stdout
    assert f"then: ttt data prepare flux --src {out}/cc12m_preprocessed --split train --out DATA" in stdout


def test_a_part_file_left_by_a_killed_download_is_continued(tmp_path):
    srv = Server(tmp_path / "bucket")
    try:
        want = bucket(tmp_path / "bucket", srv.url)
        out = tmp_path / "out"
        rel = f"{FLUX.fetch[0].folder}/data-00000-of-00001.arrow"
        (out / rel).parent.mkdir(parents=True)
        (out / (rel + ".part")).write_bytes(want[rel][:1234])
        assert download(out, srv) == 0
    finally:
        srv.close()
    assert (out / rel).read_bytes() == want[rel] and srv.ranges.count("bytes=1234-") == 1
    assert not list(out.rglob("*.part"))


def test_a_corrupted_file_is_caught(tmp_path, capsys):
    srv = Server(tmp_path / "bucket")
    try:
        bucket(tmp_path / "bucket", srv.url, corrupt=f"{FLUX.fetch[1].name}/sub/state.json")
        out = tmp_path / "out"
        assert download(out, srv) == 2
    finally:
        srv.close()
    (err,) = [e for e in errors(capsys) if not e.startswith(("flux-1-", "flux1 reference"))]
    assert "md5" in err and "does not match" in err, err
    bad = out / FLUX.fetch[1].folder / "sub"
    assert (bad / "state.json.corrupt").is_file() and not (bad / "state.json").exists()


def test_dry_run_lists_and_fetches_nothing(tmp_path, capsys):
    srv = Server(tmp_path / "bucket")
    try:
        bucket(tmp_path / "bucket", srv.url)
        assert download(tmp_path / "out", srv, "--dry-run") == 0
    finally:
        srv.close()
    lines = capsys.readouterr().out.splitlines()
    fetches = [ln for ln in lines if ln.startswith("fetch ")]
    assert len(fetches) == 3 and f"{srv.url}/metadata/flux-1-cc12m-preprocessed.uri" in fetches[0]
    assert "~2.5 TB" in fetches[0] and "text_to_image/README.md:117" in fetches[0]
    assert lines[-1] == "then: ttt run flux1 --tier reference --logdir LOGS --data DATA"
    assert srv.ranges == [] and not (tmp_path / "out").exists()


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "argv,says",
    [
        (["--for", "nope"], "unknown benchmark 'nope'"),
        (["--for", "flux1", "--tier", "huge"], "--tier 'huge' is unknown"),
        (["--for", "flux1", "--tier", "tiny"], "ttt data download fixtures"),
        (["--for", "llama2_70b_lora"], "https://llama2.mlcommons.org"),
        (["--for", "qwen35_397b_grpo", "--dry-run"], "does not run in timetotrain"),
        (["mlcommons", "--for", "flux1"], "DATASET does not go with --for"),
        (["--for", "flux1", "--mirror", "http://127.0.0.1:9/none"], "cannot be read"),
    ],
)
def test_what_cannot_be_fetched_is_one_line_and_writes_nothing(argv, says, tmp_path, capsys):
    out = tmp_path / "out"
    assert ttt(["data", "download", *argv, "--out", str(out)]) == 2
    (err,) = errors(capsys)
    assert err.startswith("ttt: error:") and says in err, err
    assert not out.exists()


@pytest.mark.bad_input
def test_a_missing_govreport_file_says_where_it_comes_from(tmp_path, capsys):
    argv = ["data", "prepare", "govreport", "--src", str(tmp_path / "gov_report" / "train.jsonl"), "--split",
            "train", "--tokenizer-model", str(tmp_path / "tokenizer.model"), "--out", str(tmp_path / "o")]  # fmt: skip
    assert ttt(argv) == 2
    (err,) = errors(capsys)
    assert "does not exist" in err and "https://huggingface.co/datasets/tau/scrolls" in err, err
    assert "ttt data download fixtures --only govreport" in err


def test_a_failed_download_leaves_no_empty_folder(tmp_path, capsys):
    """The listed files are gone from the bucket (a 404 after --out and its folders were made): the error is
    one line, and no empty folder stays to look like a download."""
    srv = Server(tmp_path / "bucket")
    try:
        bucket(tmp_path / "bucket", srv.url)
        shutil.rmtree(tmp_path / "bucket" / "files")
        out = tmp_path / "out"
        assert download(out, srv) == 2
    finally:
        srv.close()
    (err,) = [e for e in errors(capsys) if not e.startswith("flux-1-")]
    assert "HTTP 404" in err, err
    assert not out.exists()
