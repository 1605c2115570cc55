"""`ttt data download`: served from a local HTTP server on 127.0.0.1 (no internet here). An interrupted
download resumes with a Range request, a corrupted file is detected, a 404 is one line, and a C4 shard
fetched from a local mirror prepares to the same .bin/.idx as the shared fixture."""

import hashlib
import http.server
import os
import threading
from pathlib import Path

import pytest
from conftest import require_file, shared_data_dir

from timetotrain.cli import main as ttt
from timetotrain.data import download

C4_VAL = "c4/en/c4-validation.00000-of-00001.json.gz"


class Server:
    """Serves a folder with Range support; `drop_after` cuts the first response of each file after that
    many bytes (a dropped connection); `ranges` records the Range headers received."""

    def __init__(self, root: Path, drop_after: int | None = None):
        self.root, self.drop_after, self.ranges, self.dropped = root, drop_after, [], set()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                path = outer.root / self.path.lstrip("/")
                if not path.is_file():
                    self.send_error(404)
                    return
                data = path.read_bytes()
                rng = self.headers.get("Range")
                outer.ranges.append(rng)
                start = int(rng.split("=")[1].split("-")[0]) if rng else 0
                body = data[start:]
                self.send_response(206 if rng else 200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if outer.drop_after is not None and self.path not in outer.dropped:
                    outer.dropped.add(self.path)
                    self.wfile.write(body[: outer.drop_after])
                    self.close_connection = True
                    return
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def errors(capsys) -> list[str]:
    """The error lines on stderr; the rest is the progress line."""
    return [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith(("ds:", "c4 "))]


@pytest.fixture
def mirror(tmp_path):
    """A mirror laid out as the hub repository, the shared validation shard under its real name."""
    src = require_file(shared_data_dir() / C4_VAL)
    root = tmp_path / "mirror"
    (root / "en").mkdir(parents=True)
    os.symlink(src, root / "en" / "c4-validation.00000-of-00008.json.gz")
    return root


def mlcommons_tree(tmp_path: Path, corrupt: bool = False) -> Path:
    """A storage bucket: metadata/ds.uri -> files/ds, metadata/ds.md5 listing two fixture files."""
    root = tmp_path / "bucket"
    files = root / "files" / "ds"
    (files / "tok").mkdir(parents=True)
    (root / "metadata").mkdir()
    a = require_file(shared_data_dir() / C4_VAL).read_bytes()
    b = require_file(shared_data_dir() / "tokenizers" / "llama2" / "tokenizer.model").read_bytes()
    (files / "c4.json.gz").write_bytes(a)
    (files / "tok" / "tokenizer.model").write_bytes(b)
    md5 = f"{hashlib.md5(a).hexdigest()}  ./c4.json.gz\n{hashlib.md5(b).hexdigest()}  tok/tokenizer.model\n"
    (root / "metadata" / "ds.md5").write_text(md5)
    if corrupt:
        (files / "tok" / "tokenizer.model").write_bytes(b[:-1] + bytes([b[-1] ^ 1]))
    return root


def test_mlcommons_download_resumes_after_a_dropped_connection(tmp_path, capsys):
    root = mlcommons_tree(tmp_path)
    srv = Server(root, drop_after=100_000)
    try:
        (root / "metadata" / "ds.uri").write_text(f"{srv.url}/files/ds\n")
        out = tmp_path / "out"
        assert ttt(["data", "download", "mlcommons", "ds", "--metadata", f"{srv.url}/metadata/ds.uri",
                    "--out", str(out)]) == 0  # fmt: skip
    finally:
        srv.close()
    assert (out / "ds" / "c4.json.gz").read_bytes() == (root / "files" / "ds" / "c4.json.gz").read_bytes()
    assert (out / "ds" / "tok" / "tokenizer.model").is_file()
    # Each file's first response was cut at 100,000 bytes; the retry asked for the rest only.
    assert sorted(r for r in srv.ranges if r) == ["bytes=100000-", "bytes=100000-"]
    assert not list(out.rglob("*.part")) and "2 file(s)" in capsys.readouterr().out


def test_an_interrupted_download_continues_its_part_file(tmp_path, mirror):
    srv = Server(tmp_path)
    try:
        name = "c4-validation.00000-of-00008.json.gz"
        whole = (mirror / "en" / name).read_bytes()
        out = tmp_path / "out"
        out.mkdir()
        (out / (name + ".unverified.part")).write_bytes(whole[:12345])  # what a killed run left
        (files,) = download.download_c4("validation", 1, out, f"{srv.url}/mirror")
    finally:
        srv.close()
    assert files.read_bytes() == whole and srv.ranges == ["bytes=12345-"]


def test_a_corrupted_file_is_detected(tmp_path, capsys):
    root = mlcommons_tree(tmp_path, corrupt=True)
    (root / "metadata" / "ds.uri").write_text(f"file://{root}/files/ds")
    out = tmp_path / "out"
    assert ttt(["data", "download", "mlcommons", "--metadata", f"file://{root}/metadata/ds.uri",
                "--out", str(out)]) == 2  # fmt: skip
    (err,) = errors(capsys)  # one error line (progress lines aside)
    assert "md5" in err and "does not match" in err, err
    assert (out / "tok" / "tokenizer.model.corrupt").is_file() and not (
        out / "tok" / "tokenizer.model"
    ).exists()
    # A gzip shard cut short is caught by its CRC/length check.
    bad = tmp_path / "badmirror" / "en"
    bad.mkdir(parents=True)
    whole = require_file(shared_data_dir() / C4_VAL).read_bytes()
    (bad / "c4-validation.00000-of-00008.json.gz").write_bytes(whole[: len(whole) // 2])
    assert ttt(["data", "download", "c4", "--split", "validation", "--mirror", str(bad.parent),
                "--out", str(tmp_path / "c4")]) == 2  # fmt: skip
    assert "not a whole gzip file" in capsys.readouterr().err


def test_404_is_one_line(tmp_path, capsys):
    srv = Server(tmp_path)
    try:
        code = ttt(["data", "download", "mlcommons", "--metadata", f"{srv.url}/nothing/ds.uri",
                    "--out", str(tmp_path / "o")])  # fmt: skip
        code2 = ttt(["data", "download", "c4", "--split", "validation", "--mirror", f"{srv.url}/none",
                     "--out", str(tmp_path / "c")])  # fmt: skip
    finally:
        srv.close()
    err = errors(capsys)
    assert code == 2 and code2 == 2 and len(err) == 2
    assert all(e.startswith("ttt: error:") and "HTTP 404" in e for e in err), err


def test_bad_download_flags_are_one_line(capsys, tmp_path):
    assert (
        ttt(["data", "download", "c4", "--shards", "9", "--split", "validation", "--out", str(tmp_path)]) == 2
    )
    assert ttt(["data", "download", "mlcommons", "--out", str(tmp_path)]) == 2
    assert ttt(["data", "download", "mlcommons", "--metadata", "x.txt", "--out", str(tmp_path)]) == 2
    err = errors(capsys)
    assert len(err) == 3 and "--shards 9" in err[0] and "--metadata" in err[1] and ".uri" in err[2]


@pytest.mark.slow
def test_a_mirrored_c4_shard_prepares_as_the_fixture(tmp_path, mirror):
    srv = Server(tmp_path)
    try:
        assert ttt(["data", "download", "c4", "--split", "validation", "--mirror", f"{srv.url}/mirror",
                    "--out", str(tmp_path / "raw")]) == 0  # fmt: skip
    finally:
        srv.close()
    fixture = shared_data_dir() / "c4" / "en"
    for src, out in ((tmp_path / "raw", tmp_path / "a"), (fixture, tmp_path / "b")):
        assert ttt(["data", "prepare", "c4", "--src", str(src), "--split", "validation", "--out", str(out),
                    "--workers", "1"]) == 0  # fmt: skip
    for suffix in (".bin", ".idx"):
        name = "c4-validation_text_document" + suffix
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "scheme,where",
    [("http", "listed-path"), ("file", "listed-path"), ("http", "base-url"), ("file", "base-url"),
     ("file", "metadata-url")],
)  # fmt: skip
def test_a_nul_byte_in_the_metadata_is_one_line(scheme, where, tmp_path, capsys):
    """A NUL byte in a path the metadata names (a listed file, the .uri's base) or in the metadata's own
    file:// URL: the OS refuses it in a path, http.client in a URL, each with a ValueError traceback. Over
    http a %00 in the metadata URL is the server's to refuse (a 404 here)."""
    root = tmp_path / "bucket"
    (root / "metadata").mkdir(parents=True)
    (root / "files").mkdir()
    (root / "files" / "a.txt").write_bytes(b"hello")
    srv = Server(root)
    try:
        base = f"{srv.url}/files" if scheme == "http" else str(root / "files")
        if where == "base-url":
            base = base.replace("files", "fi\0les")
        listed = "a\0.txt" if where == "listed-path" else "a.txt"
        (root / "metadata" / "ds.uri").write_text(base + "\n")
        (root / "metadata" / "ds.md5").write_text(f"{hashlib.md5(b'hello').hexdigest()}  {listed}\n")
        meta = f"{srv.url}/metadata/ds.uri" if scheme == "http" else f"file://{root}/metadata/ds.uri"
        if where == "metadata-url":
            meta = f"file://{root}/meta%00data/ds.uri"
        code = ttt(["data", "download", "mlcommons", "--metadata", meta, "--out", str(tmp_path / "o")])
    finally:
        srv.close()
    err = errors(capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("ttt: error:"), err
    assert "control character '\\x00'" in err[0]
    assert not (tmp_path / "o").exists()  # refused before anything was written
