"""`ttt data download fixtures`: the tiny tiers' data rebuilt from its public sources, byte for byte.

The real sources (OLMo's C4 sample, maxtext's TFRecords, L-Eval's GovReport, ...) are not here and the
network is off, so the sources are written in their original formats from the shared fixtures (TFRecords of
`tf.train.Example`s dealt round-robin, the `date` field, L-Eval's fields), served from a folder laid out as
`--mirror` takes it, and pinned by their own sha256. What is checked is what matters: the rebuilt outputs
equal the measured fixtures byte for byte. (Against the real sources, fetched from GitHub at the pinned
commits, all seven outputs were byte-identical when this was written.)
"""

import contextlib
import functools
import gzip
import http.server
import io
import json
import os
import struct
import tarfile
import threading
import time

import pytest
from conftest import require_file, shared_data_dir

from timetotrain.cli import main
from timetotrain.data import fixtures as fx
from timetotrain.data.download import file_digest
from timetotrain.errors import UserError


def _varint(n: int) -> bytes:
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def _field(num: int, data: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(data)) + data


def _example(rec: dict) -> bytes:
    entries = b""
    for k, v in rec.items():
        feature = _field(1, _field(1, v.encode()))  # Feature.bytes_list.value
        entries += _field(1, _field(1, k.encode()) + _field(2, feature))
    return _field(1, entries)  # Example.features


def _tfrecord(payloads: list[bytes]) -> bytes:
    return b"".join(struct.pack("<Q", len(p)) + b"\0" * 4 + p + b"\0" * 4 for p in payloads)


def _records(path) -> list[dict]:
    return [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines()]


@pytest.fixture
def mirror(tmp_path):
    """The sources in their original formats, made from ../shared/data, and their sha256 pins."""
    shared = shared_data_dir()
    root = tmp_path / "mirror"
    files: dict[tuple[str, str, str], bytes] = {}
    val = _records(require_file(shared / "c4/en/c4-validation.00000-of-00001.json.gz"))
    olmo = "".join(
        json.dumps({"text": r["text"], "url": r["url"], "date": r["timestamp"]}) + "\n" for r in val
    )
    files[(*fx.OLMO, "test_fixtures/c4-sample.00000-of-00001.json.gz")] = gzip.compress(olmo.encode())
    train = _records(shared / "c4/en/c4-train.00000-of-00001.json.gz")
    for s in range(8):  # record i sits in shard i mod 8, with the extra TFDS fields
        recs = [{**r, "content-length": "1", "content-type": "text/plain"} for r in train[s::8]]
        files[(*fx.MAXTEXT, fx._TFDS.format(s))] = _tfrecord([_example(r) for r in recs])
    gov = (shared / "govreport/gov_report.validation.scrolls_format.jsonl").read_text().splitlines()
    leval = "".join(
        json.dumps(
            {"instructions": ["Summarize."], "outputs": [d["output"]], "input": d["input"], "source": "x"}
        )
        + "\n"
        for d in map(json.loads, gov)
    )
    files[(*fx.LEVAL, "LEval-data/Open-ended-tasks/gov_report_summ.jsonl")] = leval.encode()
    files[(*fx.TORCHTITAN, "tests/assets/cc12m_test/cc12m-train-0000.tar")] = (
        shared / "cc12m/cc12m-train-0000.tar"
    ).read_bytes()
    files[(*fx.MAXTEXT, "src/maxtext/assets/tokenizers/tokenizer.llama2")] = (
        shared / "tokenizers/llama2/tokenizer.model"
    ).read_bytes()
    files[(*fx.MAXTEXT, "src/maxtext/assets/tokenizers/tokenizer.mistral-v3")] = (
        shared / "tokenizers/mixtral-8x22b/tokenizer.model"
    ).read_bytes()
    pins = {}
    for (repo, commit, rel), data in files.items():
        p = root / repo / commit / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        pins[(repo, commit, rel)] = file_digest(p, "sha256")
    return root, pins


def test_rebuilt_fixtures_equal_the_measured_ones_byte_for_byte(tmp_path, mirror):
    root, pins = mirror
    out = tmp_path / "fixtures"
    src = fx.Sources(out / ".sources", str(root), pins)
    only = ["c4", "govreport", "cc12m", "tokenizers"]
    written, notes = fx.build(out, only=only, sources=src)
    assert notes == [] and len(written) == 6
    for f in written:
        rel = f.relative_to(out).as_posix()
        assert f.read_bytes() == (shared_data_dir() / rel).read_bytes(), rel
    # A second call keeps the outputs (their sha256 is the pinned one) and fetches nothing.
    for p in (out / ".sources").rglob("*"):
        if p.is_file():
            p.unlink()
    assert fx.build(out, only=only, sources=src)[0] == written


def test_coco_selection_and_layout(tmp_path):
    """Three images, one under a no-derivatives licence: two samples in id order, 256 x 256, the lowest-id
    caption stripped, the metadata the flux1 recipe reads."""
    from PIL import Image

    repo, commit = fx.COCO_MINI
    base = tmp_path / "mirror" / repo / commit
    images, anns = [], []
    for k, (w, h, lic) in enumerate([(640, 480, 1), (300, 500, 3), (500, 300, 4)]):
        name = f"{k + 10:012d}.jpg"
        (base / "train2017").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (w, h), (40 * k, 90, 200)).save(base / "train2017" / name)
        images.append({"license": lic, "file_name": name, "coco_url": "c", "flickr_url": "f", "id": k + 10})
        anns += [
            {"image_id": k + 10, "id": 100 - k, "caption": f"late {k} "},
            {"image_id": k + 10, "id": 5 + k, "caption": f" first {k}"},
        ]
    lic = [{"id": i, "name": f"licence {i}", "url": f"u{i}"} for i in range(1, 8)]
    ann = {"licenses": lic, "images": images, "annotations": anns}
    (base / "annotations").mkdir()
    (base / "annotations/captions_train2017.json").write_text(json.dumps(ann))
    (base / "annotations/captions_val2017.json").write_text(
        json.dumps({**ann, "images": [], "annotations": []})
    )
    tar = tarfile.open(
        fileobj=io.BytesIO(fx.coco_mini(fx.Sources(tmp_path / "cache", str(tmp_path / "mirror"), {})))
    )
    assert tar.getnames() == [f"0000000000{k}.{e}" for k in (10, 12) for e in ("jpg", "txt", "json")]
    meta = json.loads(tar.extractfile("000000000012.json").read())
    assert (
        meta["caption"] == "first 2" and meta["captions"] == ["first 2", "late 2"] and meta["license_id"] == 4
    )
    assert (meta["original_width"], meta["original_height"], meta["coco_split"]) == (500, 300, "train2017")
    assert Image.open(tar.extractfile("000000000010.jpg")).size == (256, 256)


@pytest.mark.bad_input
def test_a_changed_source_is_one_line_and_removed(tmp_path, mirror, capsys):
    root, _ = mirror
    llama2 = root / fx.MAXTEXT[0] / fx.MAXTEXT[1] / "src/maxtext/assets/tokenizers/tokenizer.llama2"
    llama2.write_bytes(llama2.read_bytes()[:-10])  # truncated at the source
    out = tmp_path / "fx"
    argv = ["data", "download", "fixtures", "--only", "tokenizers", "--out", str(out), "--mirror", str(root)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tokenizer.llama2: sha256" in err and "expected 9e556afd4421" in err
    assert not list((out / ".sources").rglob("tokenizer.llama2")) and not (out / "tokenizers").exists()
    assert main([*argv[:3], "--only", "imagenet", "--out", str(out)]) == 2
    assert (
        "--only imagenet: not a fixture; choose from c4, cc12m, coco_mini, govreport, tokenizers"
        in capsys.readouterr().err
    )


def test_an_offline_host_is_told_about_mirror(tmp_path, capsys, monkeypatch):
    """Without network the first download fails; the line says what to do besides trying again."""
    from timetotrain.data import download

    monkeypatch.setattr(fx, "RAW", "http://127.0.0.1:9")  # nothing listens: refused at once
    monkeypatch.setattr(download, "RETRIES", 0)
    assert main(["data", "download", "fixtures", "--out", str(tmp_path / "s"), "--only", "govreport"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ttt: error: http://127.0.0.1:9/OpenLMLab/LEval/") and len(err.splitlines()) == 1
    assert "run the command again to resume, or, where this host cannot reach GitHub, pass --mirror" in err
    assert "a folder already in the final layout" in err and "pass it as it is" in err
    assert not (tmp_path / "s").exists()  # no empty `.sources/` tree: nothing was fetched, nothing is left
    # A mirror nobody serves fails the same way; a folder that was there stays, and stays as it was.
    (tmp_path / "t" / "mine").mkdir(parents=True)
    argv = ["data", "download", "fixtures", "--out", str(tmp_path / "t"), "--mirror", "http://127.0.0.1:9"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--mirror URL" not in err and "pass it as it is" in err
    assert sorted(p.name for p in (tmp_path / "t").rglob("*")) == ["mine"]


# -- the test session's copy in the user's cache (tests/conftest.py pytest_sessionstart) --


@contextlib.contextmanager
def _served(root):
    """`root` served over HTTP on 127.0.0.1 only (GET and HEAD), as raw.githubusercontent.com serves the
    sources."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


FETCHED = ["govreport", "tokenizers"]  # two small outputs: one rebuilt from its source, one as it is


def test_a_session_fetches_the_fixtures_into_its_cache(tmp_path, mirror, monkeypatch):
    root, pins = mirror
    monkeypatch.delenv("TTT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cache = fx.cache_dir()
    assert cache == tmp_path / "xdg" / "timetotrain" / "fixtures"
    with _served(root) as url:
        got, notes = fx.fetch_cached(cache, url, pins, only=FETCHED)
    assert got == cache and notes == [] and (cache / fx.COMPLETE).is_file()
    rels = sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file())
    assert rels == sorted([fx.COMPLETE, *(r for r in fx.OUTPUTS if r.split("/")[0] in FETCHED)])
    for rel in rels[1:]:  # the layout ../shared/data has, byte for byte; the sources are not kept
        assert (cache / rel).read_bytes() == (shared_data_dir() / rel).read_bytes(), rel
    assert [p.name for p in cache.parent.iterdir()] == ["fixtures"]  # no partial folder beside it
    # The next session uses it as it is: no server, no network.
    assert fx.fetch_cached(cache, "http://127.0.0.1:9", pins, only=FETCHED) == (cache, [])
    monkeypatch.setenv("TTT_CACHE", str(tmp_path / "team"))  # the data cache a team shares, where set
    assert fx.cache_dir() == tmp_path / "team" / "fixtures"


def test_a_failed_fetch_leaves_nothing_behind(tmp_path, mirror):
    root, pins = mirror
    cache = tmp_path / "xdg" / "timetotrain" / "fixtures"
    llama2 = root / fx.MAXTEXT[0] / fx.MAXTEXT[1] / "src/maxtext/assets/tokenizers/tokenizer.llama2"
    llama2.write_bytes(llama2.read_bytes()[:-10])  # the last source fetched is changed at its source
    with _served(root) as url, pytest.raises(UserError, match="tokenizer.llama2: sha256"):
        fx.fetch_cached(cache, url, pins, only=FETCHED)
    assert not (tmp_path / "xdg").exists()  # not the fetched govreport source, not even the parents it made
    # Offline (nothing listens): told within the probe's timeout, before anything is written.
    (tmp_path / "xdg").mkdir()
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"^127.0.0.1:9 not reached in 5 s \("):
        fx.fetch_cached(cache, "http://127.0.0.1:9", pins)
    assert time.monotonic() - t0 < 5 and list((tmp_path / "xdg").iterdir()) == []
    # A folder in the way that no fetch made is not taken for one, nor written into.
    (cache / "c4").mkdir(parents=True)
    with _served(root) as url, pytest.raises(UserError, match=r"holds files but no \.complete"):
        fx.fetch_cached(cache, url, pins, only=FETCHED)
    assert [p.name for p in cache.iterdir()] == ["c4"]


def test_the_session_start_points_the_tests_at_the_fetched_cache(tmp_path, mirror, monkeypatch):
    """conftest's pytest_sessionstart on a fresh clone: fetched, then TTT_SHARED_DATA names the cache for
    the tests, the xdist workers it starts next and every subprocess."""
    import conftest

    root, pins = mirror
    # Set first, so that the value the session start writes is undone after the test whatever it was.
    monkeypatch.setenv("TTT_SHARED_DATA", "-")
    monkeypatch.delenv("TTT_SHARED_DATA")
    monkeypatch.delenv(conftest.FETCH_ENV, raising=False)
    monkeypatch.delenv("TTT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(conftest, "REPO", tmp_path / "clone")  # no ../shared/data beside it
    monkeypatch.setattr(conftest, "_FETCH", {})
    real = fx.fetch_cached
    lines = []
    reporter = type("R", (), {"write_line": lambda self, line, **kw: lines.append(line)})()
    session = type("S", (), {})()
    session.config = type(
        "C", (), {"pluginmanager": type("P", (), {"get_plugin": lambda self, n: reporter})()}
    )()
    with _served(root) as url:
        monkeypatch.setenv(conftest.MIRROR_ENV, url)
        monkeypatch.setattr(fx, "fetch_cached", lambda cache, base: real(cache, base, pins, only=FETCHED))
        conftest.pytest_sessionstart(session)
    cache = tmp_path / "xdg" / "timetotrain" / "fixtures"
    assert os.environ["TTT_SHARED_DATA"] == str(cache) and conftest.shared_data_dir() == cache
    assert conftest._FETCH == {"cache": cache, "fetched": True} and "fetching them once into" in lines[0]
    assert (cache / "tokenizers/llama2/tokenizer.model").is_file()


def test_a_session_told_not_to_fetch_or_given_the_data_fetches_nothing(tmp_path, monkeypatch):
    import conftest

    monkeypatch.setattr(conftest, "REPO", tmp_path / "clone")
    monkeypatch.setattr(conftest, "_FETCH", {})
    monkeypatch.setattr(fx, "fetch_cached", lambda *a: pytest.fail("fetched"))
    session = type("S", (), {"config": None})()
    monkeypatch.setenv("TTT_SHARED_DATA", str(tmp_path / "mine"))  # the user's folder, even a missing one
    conftest.pytest_sessionstart(session)
    monkeypatch.delenv("TTT_SHARED_DATA")
    monkeypatch.setenv(conftest.FETCH_ENV, "0")
    conftest.pytest_sessionstart(session)
    assert conftest._FETCH == {} and "TTT_SHARED_DATA" not in os.environ
