"""Untrusted input never executes (issue 22): a hostile pickle planted in every pickle-bearing format ttt
reads does not run, no value from a log reaches a shell unquoted, served download metadata cannot reach
local files, no symlink or index entry leads out of the tree it was given, and no log value becomes
markup in a chart or in summary.md.

Each hostile payload is shown to be live first (plain `pickle.loads` does create the marker), so a test
that then finds no marker proves the refusal, not a dud payload. Command cases run `timetotrain.cli.main`
in this process and expect what test_bad_input.py expects: one `ttt: error:` line naming the file, exit 2.
"""

from __future__ import annotations

import io
import os
import pickle
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo

from timetotrain.cli import main
from timetotrain.errors import UserError
from timetotrain.spec.registry import get
from timetotrain.train import checkpoint as ckpt
from timetotrain.train import dcp_safe
from timetotrain.train.optim import build_adamw
from timetotrain.train.step import build_training

pytestmark = pytest.mark.bad_input

BENCH = get("llama31_8b")
TIER = BENCH.tier("tiny")


class Planted:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def live_payload(marker: Path, wrap=lambda x: x) -> bytes:
    """pickle.dumps(wrap(Planted(marker))), checked to create the marker when plainly unpickled."""
    data = pickle.dumps(wrap(Planted(marker)))
    pickle.loads(data)
    assert marker.exists(), "the planted payload is a dud"
    marker.unlink()
    return data


def one_error_line(capsys, code: int) -> str:
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ttt: error: "), err
    return lines[0]


def run_cli(argv: list[str]) -> int:
    try:
        return main([str(a) for a in argv])
    except SystemExit as e:
        return e.code


# --- checkpoints: torch.distributed.checkpoint folders ------------------------------------------------


@pytest.fixture(scope="module")
def ttt_checkpoint(tmp_path_factory) -> Path:
    """A genuine model-only ttt checkpoint of llama31_8b tiny (what --init-checkpoint reads)."""
    tr = build_training(BENCH, TIER, torch.device("cpu"), seed=7)
    path = tmp_path_factory.mktemp("ck") / "ck"
    ckpt.save_checkpoint(path, tr.bare, None, step=0)
    return path


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _run_init(c4: Path, folder: Path, logdir: Path) -> list[str]:
    return [
        "run",
        "llama31_8b",
        "--tier",
        "tiny",
        "--data",
        c4,
        "--logdir",
        logdir,
        "--init-checkpoint",
        folder,
    ]


@pytest.mark.parametrize("where", ["whole-file", "nested-in-metadata"])
def test_planted_metadata_pickle_does_not_run(where, ttt_checkpoint, c4_prepared, tmp_path, capsys):
    marker = tmp_path / "pwned"
    folder = _copy(ttt_checkpoint, tmp_path / "ck")
    if where == "whole-file":
        payload = live_payload(marker)
    else:  # DCP's own Metadata, every class allowed, with the object inside its planner data
        meta = pickle.loads((folder / ".metadata").read_bytes())

        def wrap(obj):
            meta.planner_data = {"x": obj}
            return meta

        payload = live_payload(marker, wrap)
    (folder / ".metadata").write_bytes(payload)
    logdir = tmp_path / "logs"
    line = one_error_line(capsys, run_cli(_run_init(c4_prepared, folder, logdir)))
    assert f"{folder}/.metadata" in line and "refusing to unpickle" in line and "posix.system" in line
    assert not marker.exists()
    assert not list(logdir.rglob("result_*"))  # refused in preflight, before any log


def _repoint(folder: Path, fqn_prefix: str, payload: bytes) -> None:
    """Rewrite the (genuine, allowed) metadata so the entries starting with `fqn_prefix` are read from a
    new file holding `payload`."""
    (folder / "planted.distcp").write_bytes(payload)
    meta = pickle.loads((folder / ".metadata").read_bytes())
    hits = [k for k in meta.storage_data if k.fqn.startswith(fqn_prefix)]
    assert hits
    for k in hits:
        meta.storage_data[k] = _StorageInfo("planted.distcp", 0, len(payload))
    (folder / ".metadata").write_bytes(pickle.dumps(meta))


def test_planted_tensor_shard_does_not_run(ttt_checkpoint, tmp_path):
    marker = tmp_path / "pwned"
    folder = _copy(ttt_checkpoint, tmp_path / "ck")

    def as_torch_save(obj):
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()

    payload = as_torch_save(Planted(marker))
    torch.load(io.BytesIO(payload), weights_only=False)
    assert marker.exists()
    marker.unlink()
    _repoint(folder, "model.embed.weight", payload)
    tr = build_training(BENCH, TIER, torch.device("cpu"), seed=8)
    with pytest.raises(UserError, match=r"a shard cannot be read .*weights_only|the checkpoint is damaged"):
        ckpt.load_checkpoint(folder, tr.bare, None)
    assert not marker.exists()


def test_planted_optimizer_entry_does_not_run(tmp_path):
    """Non-tensor entries (an optimizer's param groups) are read with torch.load(weights_only=True); DCP's
    own planner reads them with weights_only=False."""
    from conftest import small_llama

    from timetotrain.models.llama import Llama

    model = Llama(small_llama())
    opt = build_adamw(model, 1e-3, (0.9, 0.95), 1e-5, 0.1, fused=False)
    folder = tmp_path / "ck"
    ckpt.save_checkpoint(folder, model, opt, step=1)
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(Planted(marker), buf)
    _repoint(folder, "optim.param_groups.0.lr", buf.getvalue())
    with pytest.raises(UserError, match=r"optim\.param_groups\.0\.lr in the checkpoint is not plain data"):
        ckpt.load_checkpoint(folder, model, opt)
    assert not marker.exists()
    # The genuine entries load: a saved optimizer state still round-trips (tests/test_checkpoint.py too).
    ckpt.save_checkpoint(folder, model, opt, step=1)
    assert ckpt.load_checkpoint(folder, model, opt) == (1, {})


@pytest.mark.parametrize("rel", ["../outside.distcp", "/etc/passwd", "sub/x.distcp", "link.distcp"])
def test_metadata_cannot_point_out_of_the_folder(rel, ttt_checkpoint, tmp_path):
    folder = _copy(ttt_checkpoint, tmp_path / "ck")
    (tmp_path / "outside.distcp").write_bytes(b"x" * 64)
    (folder / "link.distcp").symlink_to(tmp_path / "outside.distcp")
    meta = pickle.loads((folder / ".metadata").read_bytes())
    first = next(iter(meta.storage_data))
    meta.storage_data[first] = _StorageInfo(rel, 0, 64)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(UserError, match=r"\.metadata: storage (entry|file) .*refusing to read it"):
        dcp_safe.read_metadata(folder)


# --- generated scripts: ttt package's run_and_time.sh --------------------------------------------------


def hostile(what: str) -> str:
    """A value that runs `touch pwned` (in the current folder) if a shell reads it as code, whichever
    quoting it lands in: bare, double quotes, after `;`, on a new line."""
    return f"{what}$(touch pwned)`touch pwned`;touch pwned\n'\"\\ && touch pwned #"


def test_the_hostile_value_is_live(tmp_path):
    import subprocess

    subprocess.run(["bash", "-c", f"echo {hostile('x')}"], cwd=tmp_path, capture_output=True)
    assert (tmp_path / "pwned").exists()


def _edit_log(path: Path, values: dict, add: dict) -> None:
    """Replace the values of logged keys and add keys before init_stop, as a log of `ttt run` holds them."""
    import json

    out = []
    for ln in path.read_text().splitlines():
        rec = json.loads(ln.removeprefix(":::MLLOG "))
        if rec["key"] == "init_stop":
            for k, v in add.items():
                out.append(
                    ":::MLLOG " + json.dumps({**rec, "event_type": "POINT_IN_TIME", "key": k, "value": v})
                )
        if rec["key"] in values:
            rec["value"] = values[rec["key"]]
        out.append(":::MLLOG " + json.dumps(rec))
    path.write_text("\n".join(out) + "\n")


def stub_ttt(folder: Path) -> tuple[Path, Path]:
    """A `ttt` on PATH that records its argv (one JSON list a line) instead of running."""
    import sys

    folder.mkdir()
    calls = folder / "calls.jsonl"
    stub = folder / "ttt"
    threads = folder / "threads.txt"  # the OMP_NUM_THREADS each call saw ("-": unset)
    stub.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        f"open({str(threads)!r}, 'a').write(os.environ.get('OMP_NUM_THREADS', '-') + '\\n')\n"
    )
    stub.chmod(0o755)
    return folder, calls


def run_script(script: Path, stub_dir: Path, cwd: Path, **env) -> None:
    import subprocess

    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    env = {"PATH": f"{stub_dir}:/usr/bin:/bin", "HOME": str(stub_dir), **env}
    proc = subprocess.run(["bash", str(script)], env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_no_logged_value_reaches_the_shell(tmp_path, capsys, monkeypatch):
    import json

    from fakelogs import tier_log, ttt_main

    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"
    keys = ("tier", "seed", "platform", "set", "steps", "ckpt", "data", "org", "system")
    v = {k: hostile(k) for k in keys}
    results = tmp_path / "logs"
    for i in range(3):
        log = tier_log(results / f"result_{i}.txt", 10 + i, 640, 2.0, start_ms=1_767_225_600_000 + i * 10**6)
        _edit_log(
            log,
            {"ttt_tier": v["tier"], "seed": v["seed"] + str(i), "submission_platform": v["platform"]},
            {"ttt_set": [v["set"]], "ttt_max_steps": v["steps"], "ttt_init_checkpoint": v["ckpt"]}
            | {"ttt_data": v["data"]},
        )
    out = tmp_path / "pkg"
    argv = [
        "package",
        "--org",
        v["org"],
        "--system",
        v["system"],
        "--results",
        str(results),
        "--out",
        str(out),
        "--allow-noncompliant",  # the hostile tier has no rule file: these logs fail the compliance checker
    ]
    assert ttt_main(argv) == 0, capsys.readouterr().err
    (script,) = out.rglob("run_and_time.sh")
    stub_dir, calls = stub_ttt(tmp_path / "bin")
    run_script(script, stub_dir, tmp_path, LOGDIR=str(tmp_path / "new"))
    assert not marker.exists()
    got = [json.loads(ln) for ln in calls.read_text().splitlines()]
    want = [
        ["run", "llama31_8b", "--tier", v["tier"], "--data", v["data"], "--logdir", str(tmp_path / "new")]
        + ["--seed", v["seed"] + str(i), "--org", v["org"], "--platform", v["platform"], "--set", v["set"]]
        + ["--max-steps", v["steps"], "--init-checkpoint", v["ckpt"]]
        for i in range(3)
    ]
    assert got == want  # each value arrives as the one word it was, byte for byte
    assert "\\$(touch" in (script.parent / "README.md").read_text()  # escaped in the markdown too


def test_settings_of_older_logs_are_quoted_too(tmp_path, monkeypatch):
    """A log without ttt_set: the settings that differ from the tier's become --set values, quoted."""
    import json

    from fakelogs import tier_log

    from timetotrain.mlperf.package import run_and_time
    from timetotrain.mlperf.results import find_groups

    monkeypatch.chdir(tmp_path)
    log = tier_log(tmp_path / "logs" / "result_0.txt", 10, 640, 2.0)
    _edit_log(log, {"opt_base_learning_rate": hostile("lr"), "seed": hostile("seed")}, {})
    (g,) = find_groups(tmp_path / "logs")
    script = tmp_path / "run_and_time.sh"
    script.write_text(run_and_time(g, g.logs, "o", "s"))
    stub_dir, calls = stub_ttt(tmp_path / "bin")
    run_script(script, stub_dir, tmp_path, DATA=str(tmp_path))
    assert not (tmp_path / "pwned").exists()
    (argv,) = [json.loads(ln) for ln in calls.read_text().splitlines()]
    assert argv[argv.index("--seed") + 1] == hostile("seed")
    assert argv[argv.index("--set") + 1] == "lr=" + hostile("lr")


def test_a_package_repeats_its_run(ttt_checkpoint, c4_prepared, tmp_path, capsys):
    """issue 29: the script carries the run's inputs (checkpoint, data, --set values, --max-steps): a real
    `ttt run`, packaged, and the command the script runs parses to the same run."""
    import json

    from fakelogs import ttt_main

    from timetotrain.cli import build_parser
    from timetotrain.mlperf.results import find_groups

    logs = tmp_path / "logs"
    argv = ["run", "llama31_8b", "--tier", "tiny", "--data", str(c4_prepared), "--logdir", str(logs)]
    argv += ["--seed", "3", "--max-steps", "1", "--quiet", "--init-checkpoint", str(ttt_checkpoint)]
    argv += ["--set", "eval_every_samples=64", "--platform", "box 1"]
    assert main(argv) == 1  # aborted at the step limit: a run, not an error
    capsys.readouterr()
    out = tmp_path / "pkg"
    assert (
        ttt_main(["package", "--org", "o", "--system", "s", "--results", str(logs), "--out", str(out)]) == 0
    )
    (script,) = out.rglob("run_and_time.sh")
    stub_dir, calls = stub_ttt(tmp_path / "bin")
    run_script(script, stub_dir, tmp_path, LOGDIR=str(tmp_path / "again"))
    (again,) = [json.loads(ln) for ln in calls.read_text().splitlines()]
    first, second = build_parser().parse_args(argv), build_parser().parse_args(again)
    for field in ("benchmark", "tier", "seed", "max_steps", "set", "init_checkpoint", "platform"):
        assert getattr(second, field) == getattr(first, field), field
    assert Path(second.data) == Path(c4_prepared).resolve()
    # A CPU run's bits hold at its thread count: the script runs at the logged one unless told otherwise.
    logged = torch.get_num_threads()
    (g,) = find_groups(logs)
    assert g.logs[0].keys["ttt_cpu_threads"] == logged
    assert (tmp_path / "bin" / "threads.txt").read_text() == f"{logged}\n"
    run_script(script, stub_dir, tmp_path, LOGDIR=str(tmp_path / "again"), OMP_NUM_THREADS="7")
    assert (tmp_path / "bin" / "threads.txt").read_text().splitlines()[-1] == "7"


@pytest.mark.parametrize("threads", ["2; touch pwned", 0, 1.5])
def test_a_logged_thread_count_that_is_not_one_is_refused(tmp_path, capsys, threads):
    from fakelogs import tier_log, ttt_main

    log = tier_log(tmp_path / "logs" / "result_0.txt", 10, 640, 2.0)
    _edit_log(log, {}, {"ttt_cpu_threads": threads})
    argv = [
        "package",
        "--org",
        "o",
        "--system",
        "s",
        "--results",
        str(tmp_path / "logs"),
        "--out",
        str(tmp_path / "p"),
    ]
    assert ttt_main(argv) == 2
    err = capsys.readouterr().err
    assert "result_0.txt: ttt_cpu_threads" in err and "not a thread count" in err
    assert not (tmp_path / "p").exists()


# --- log values shown as text: Plotly labels, summary.md -----------------------------------------------

LINK = '<a href="https://evil.example">x</a><b>b</b><br>'
MD_TRAPS = "`code` | [link](https://evil.example) ![i](x.png) <b>b</b> *e* ~s~ $m$ https://evil.example"


def _hostile_results(root: Path) -> Path:
    from fakelogs import tier_log

    for i in range(3):
        log = tier_log(root / f"result_{i}.txt", 10 + i, 640, 2.0, start_ms=1_767_225_600_000 + i * 10**6)
        values = {"seed": f"{LINK}{i}", "submission_org": "# " + MD_TRAPS, "submission_platform": MD_TRAPS}
        _edit_log(log, values, {})
    return root


def test_plotly_labels_show_log_values_as_text(tmp_path):
    import json

    from timetotrain.mlperf.results import find_groups
    from timetotrain.mlperf.score import score_group
    from timetotrain.report import html as report_html

    (g,) = find_groups(_hostile_results(tmp_path / "logs"))
    fig = report_html.group_figure(g, score_group(g))
    labels = [t["name"] for t in fig["data"]] + [t["hovertemplate"].split("<br>")[0] for t in fig["data"][:3]]
    labels.append(fig["layout"]["title"]["text"])
    assert any("&lt;a href=" in n for n in labels)  # the value is there, as text
    assert not any("<a" in n or "<b>" in n or "<br>" in n.split("<extra>")[0] for n in labels)
    doc = {"benchmark": LINK, "tier": "tiny", "item": "tokens", "tokens_per_s": 1.0, "mfu": 0.1}
    (tmp_path / "logs" / "summary_0.json").write_text(json.dumps(doc))
    html, figs = report_html._synth_section(report_html.synth_summaries(tmp_path / "logs"))
    assert LINK not in html and "&lt;a href=" in html  # the table shows the value as text
    (synth,) = figs.values()
    texts = [synth["layout"]["title"]["text"]] + [str(t) for tr in synth["data"] for t in tr.get("x", [])]
    assert any("&lt;a href=" in t for t in texts)
    assert not any("<a" in t for t in texts)


def _cells(row: str) -> list[str]:
    """A markdown table row's cells, split on the pipes a renderer splits on (not backslash-escaped)."""
    import re

    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def test_summary_md_escapes_log_values(tmp_path):
    import re

    from timetotrain.mlperf.results import find_groups
    from timetotrain.mlperf.score import score_group
    from timetotrain.report.summary import summary_markdown

    (g,) = find_groups(_hostile_results(tmp_path / "logs"))
    text = summary_markdown([score_group(g)], [tmp_path / "llama31_8b-tiny.png"])
    tables = [ln for ln in text.splitlines() if ln.startswith("|")]
    widths = {len(_cells(ln)) for ln in tables if "---" not in ln}
    assert widths == {13, 6}, widths  # the score table and the runs table: no cell split by a value's pipe
    unescaped = re.compile(r"(?<!\\)[`\[\]<>*~$]|(?<!\\)https?:")
    value_lines = [ln for ln in text.splitlines() if "evil" in ln]
    assert len(value_lines) >= 5  # the values are all there (score row, heading, three runs)
    for ln in value_lines:
        for cell in _cells(ln) if ln.startswith("|") else [ln.removeprefix("### ")]:
            assert "evil" not in cell or not unescaped.search(cell), cell
    assert not any(
        ln.startswith("#") and "evil" in ln and not ln.startswith("### ") for ln in text.splitlines()
    )


# --- downloads: served metadata names only served files, written only inside --out --------------------


def _bucket(tmp_path: Path, secret: Path) -> tuple[Path, str]:
    """A served bucket whose ds.md5 lists `secret`'s file under its real md5 (so a copy would verify)."""
    import hashlib

    root = tmp_path / "bucket"
    (root / "metadata").mkdir(parents=True)
    digest = hashlib.md5((secret / "id_rsa").read_bytes()).hexdigest()
    (root / "metadata" / "ds.md5").write_text(f"{digest}  id_rsa\n")
    return root, digest


def _secret(tmp_path: Path) -> Path:
    d = tmp_path / "home" / ".ssh"
    d.mkdir(parents=True)
    (d / "id_rsa").write_text("PRIVATE KEY\n")
    return d


@pytest.mark.parametrize("base", ["file://{secret}", "{secret}", "ftp://127.0.0.1{secret}"])
def test_served_metadata_cannot_name_local_files(base, tmp_path, capsys):
    from test_download import Server

    secret = _secret(tmp_path)
    root, _ = _bucket(tmp_path, secret)
    (root / "metadata" / "ds.uri").write_text(base.format(secret=secret) + "\n")
    srv = Server(root)
    out = tmp_path / "out"
    try:
        code = run_cli(["data", "download", "mlcommons", "ds", "--metadata", f"{srv.url}/metadata/ds.uri"]
                       + ["--out", out])  # fmt: skip
    finally:
        srv.close()
    line = one_error_line(capsys, code)
    assert "--metadata http://127.0.0.1:" in line and "not an http(s) URL" in line
    assert not [p for p in out.rglob("*") if p.is_file()]


def test_downloads_stay_inside_out(tmp_path, capsys):
    """A symlinked folder under --out does not redirect a download: the path is checked after resolving."""
    import hashlib

    from test_download import Server

    root = tmp_path / "bucket"
    (root / "files" / "tok").mkdir(parents=True)
    (root / "metadata").mkdir()
    (root / "files" / "tok" / "x.model").write_bytes(b"model")
    md5 = hashlib.md5(b"model").hexdigest()
    (root / "metadata" / "ds.md5").write_text(f"{md5}  tok/x.model\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    srv = Server(root)
    (root / "metadata" / "ds.uri").write_text(f"{srv.url}/files\n")
    out = tmp_path / "out"
    (out / "ds").mkdir(parents=True)
    (out / "ds" / "tok").symlink_to(elsewhere)
    try:
        code = run_cli(["data", "download", "mlcommons", "ds", "--metadata", f"{srv.url}/metadata/ds.uri"]
                       + ["--out", out])  # fmt: skip
    finally:
        srv.close()
    line = one_error_line(capsys, code)
    assert "tok/x.model" in line and "outside --out" in line
    assert list(elsewhere.iterdir()) == []


# --- symlinks and index entries out of the given folder ------------------------------------------------


def _tree_with_outside_link(tmp_path: Path) -> tuple[Path, Path]:
    from fakelogs import tier_log

    root = tmp_path / "logs" / "llama31_8b" / "tiny"
    for i in range(3):
        tier_log(root / f"result_{i}.txt", 10 + i, 640, 2.0, start_ms=1_767_225_600_000 + i * 10**6)
    outside = tier_log(tmp_path / "elsewhere" / "result_9.txt", 99, 640, 1.0)
    (root / "result_3.txt").symlink_to(outside)
    (root / "result_4.txt").symlink_to(root / "result_0.txt")  # a link inside the tree is fine...
    return tmp_path / "logs", root / "result_3.txt"


@pytest.mark.parametrize(
    "argv",
    [
        ["score", "{logs}"],
        ["report", "{logs}", "--out", "{w}/report"],
        ["report", "{logs}", "--html", "{w}/r.html"],
        ["package", "--org", "o", "--system", "s", "--results", "{logs}", "--out", "{w}/pkg"],
    ],
    ids=["score", "report", "report-html", "package"],
)
def test_result_trees_refuse_links_out_of_the_tree(argv, tmp_path, capsys):
    from fakelogs import ttt_main

    logs, link = _tree_with_outside_link(tmp_path)
    argv = [a.format(logs=logs, w=tmp_path) for a in argv]
    line = one_error_line(capsys, ttt_main(argv))
    assert f"{link} resolves to {tmp_path / 'elsewhere' / 'result_9.txt'}, outside {logs}" in line
    assert not (tmp_path / "pkg").exists() and not (tmp_path / "r.html").exists()
    (logs / "llama31_8b" / "tiny" / "result_3.txt").unlink()
    assert ttt_main(["score", str(logs)]) == 0  # ...as the same tree without the outside link shows
    capsys.readouterr()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """llama31_8b tiny weights as a sharded Hugging Face checkpoint."""
    from conftest import require

    from timetotrain.models.llama.hf import hf_config_kwargs

    transformers = require("transformers")
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config_kwargs(TIER.model))).float()
    out = tmp_path_factory.mktemp("hf") / "hf"
    hf.save_pretrained(out, safe_serialization=True, max_shard_size=2_000_000)
    return out


@pytest.mark.parametrize("how", ["index-names-parent", "shard-is-a-link-out", "index-is-a-link-out"])
def test_hf_checkpoints_are_read_only_inside_their_folder(how, hf_folder, c4_prepared, tmp_path, capsys):
    import json
    import shutil

    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    index_path = folder / ckpt.HF_INDEX
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    shutil.move(folder / shard, tmp_path / "outside.safetensors")
    if how == "index-names-parent":
        index["weight_map"] = {
            k: "../outside.safetensors" if v == shard else v for k, v in index["weight_map"].items()
        }
        index_path.write_text(json.dumps(index))
        named = "'../outside.safetensors' is not a file name of this folder"
    elif how == "shard-is-a-link-out":
        (folder / shard).symlink_to(tmp_path / "outside.safetensors")
        named = f"{folder / shard} resolves to {tmp_path / 'outside.safetensors'}, outside {folder}"
    else:
        (folder / shard).symlink_to(tmp_path / "outside.safetensors")
        shutil.move(index_path, tmp_path / "index.json")
        index_path.symlink_to(tmp_path / "index.json")
        named = f"{index_path} resolves to {tmp_path / 'index.json'}, outside {folder}"
    logdir = tmp_path / "logs"
    line = one_error_line(capsys, run_cli(_run_init(c4_prepared, folder, logdir)))
    assert named in line, line
    assert not list(logdir.rglob("result_*"))  # refused in preflight


def _encoders(tmp_path: Path) -> Path:
    enc = tmp_path / "enc"
    for sub in ("t5", "clip", "vae"):
        (enc / sub).mkdir(parents=True)
        (enc / sub / "config.json").write_text("{}")
        (enc / sub / "model.safetensors").write_bytes(b"")
    return enc


def test_encoder_folders_refuse_links_out_and_pickled_weights(tmp_path, capsys):
    from conftest import require

    require("transformers")
    require("diffusers")
    enc = _encoders(tmp_path)
    (tmp_path / "outside.safetensors").write_bytes(b"")
    (enc / "vae" / "model.safetensors").unlink()
    (enc / "vae" / "model.safetensors").symlink_to(tmp_path / "outside.safetensors")
    src = tmp_path / "src"
    src.mkdir()
    argv = [
        "data",
        "prepare",
        "flux",
        "--src",
        src,
        "--split",
        "train",
        "--encoders",
        enc,
        "--out",
        tmp_path / "o",
    ]
    line = one_error_line(capsys, run_cli(argv))
    assert f"{enc / 'vae' / 'model.safetensors'} resolves to {tmp_path / 'outside.safetensors'}" in line

    marker = tmp_path / "pwned"
    (enc / "vae" / "model.safetensors").unlink()
    buf = io.BytesIO()
    torch.save({"w": Planted(marker)}, buf)
    (enc / "vae" / "diffusion_pytorch_model.bin").write_bytes(buf.getvalue())
    line = one_error_line(capsys, run_cli(argv))
    assert "vae/ has no *.safetensors weights" in line
    assert not marker.exists()


# --- .npy files: an object array is refused, never unpickled -------------------------------------------


def _npy_readers():
    from timetotrain.data import flux_encodings, igbh, loader, mapped, vocab_table

    shapes = flux_encodings.Shapes(t5=(2, 3), clip=(3,), latent=(4, 2, 2))
    return {
        "token-counts": ("c4-train_token_counts.npy", lambda p: loader._load_counts(p)),
        "base-vocab-table": (vocab_table.VOCAB_TABLE, lambda p: vocab_table.load_vocab_table(p.parent, 3)),
        "flux-empty-encodings": (
            "t5_empty.npy",
            lambda p: flux_encodings.read_empty_arrays(p.parent, shapes),
        ),
        "igbh-array": ("node_feat.npy", lambda p: igbh._header(p)),
        "mapped-array": ("x.npy", lambda p: mapped.MappedFiles().load(p)),
    }


@pytest.mark.parametrize("reader", list(_npy_readers()))
def test_object_npy_is_refused(reader, tmp_path):
    import numpy as np

    name, read = _npy_readers()[reader]
    marker = tmp_path / "pwned"
    path = tmp_path / name
    np.save(path, np.array([Planted(marker)], dtype=object), allow_pickle=True)
    np.save(tmp_path / "clip_empty.npy", np.zeros(3, np.float32))
    np.load(path, allow_pickle=True)
    assert marker.exists()  # live
    marker.unlink()
    with pytest.raises(UserError, match=str(tmp_path)):
        read(path)
    assert not marker.exists()


def _module_calls():
    """(file, line, module, attribute, keywords) of every `<module>.<attribute>` use in timetotrain/ whose
    module is np, numpy, torch or pickle."""
    import ast

    root = Path(__file__).resolve().parents[1] / "timetotrain"
    for f in sorted(root.rglob("*.py")):
        tree = ast.parse(f.read_text())
        calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id in ("np", "numpy", "torch", "pickle"):
                    call = calls.get(id(node))
                    kw = {k.arg: k.value for k in call.keywords} if call is not None else None
                    yield f, node.lineno, node.value.id, node.attr, kw


def test_no_reader_can_unpickle():
    """Every np.load passes allow_pickle=False, every torch.load weights_only=True, and pickle is only
    read in dcp_safe.py, through its restricted Unpickler subclass."""
    import ast

    def const(v, want) -> bool:
        return isinstance(v, ast.Constant) and v.value is want

    uses = list(_module_calls())
    loads = [(f, ln, m, kw) for f, ln, m, a, kw in uses if a == "load" and m != "pickle"]
    assert any(m == "np" for _, _, m, _ in loads)  # the scan sees them
    for f, ln, m, kw in loads:
        if m in ("np", "numpy"):
            assert kw is not None and const(kw.get("allow_pickle"), False), f"{f}:{ln}: np.load"
        else:
            assert kw is not None and const(kw.get("weights_only"), True), f"{f}:{ln}: torch.load"
    readers = [(f.name, a) for f, _, m, a, _ in uses if m == "pickle" and a in ("load", "loads", "Unpickler")]
    assert readers == [("dcp_safe.py", "Unpickler")]


# --- every file a user names is read with a bound (issue 37) ---


def _padded(doc: str) -> bytes:
    """`doc` (valid as it is) followed by 2 kB of spaces: over the 1 kB bound the test sets, and still
    valid, so a reader without a bound parses it and the test sees no error."""
    return doc.encode() + b" " * 2048


def _over(reader, name: str, text: str):
    def case(tmp_path: Path):
        (tmp_path / name).write_bytes(_padded(text))
        return tmp_path / name, lambda: reader(tmp_path)

    return case


def _read_config(d):
    from timetotrain.cli import config

    config.load(str(d / "c.toml"))


def _read_manifest(d):
    from timetotrain.data.manifest import read_manifest

    read_manifest(d, "c4-train")


def _read_base(d):
    from timetotrain.train.base_model import read_base

    read_base(d)


def _read_rcp(d):
    from timetotrain.mlperf.rcp import RcpTable

    RcpTable.load(d / "rcps.json", "llama31_8b", 10)


def _read_scaling(d):
    from timetotrain.mlperf.score import scaling_factor

    scaling_factor(d)


def _read_system_json(d):
    from timetotrain.mlperf.package import _load_system_json

    _load_system_json(d / "sys.json")


def _read_metadata(d):
    from timetotrain.data.download import read_text

    read_text(f"file://{d}/ds.uri")


def _read_hf_config(d):
    ckpt.check_hf_config(d)


def _read_index(d):
    ckpt._weight_map(d)


def _read_log(d):
    from timetotrain.mlperf.results import parse_log

    parse_log(d / "result_0.txt")


def _npy_over(reader, name: str):
    def case(tmp_path: Path):
        buf = io.BytesIO()
        np.save(buf, np.arange(8, dtype=np.int64))
        (tmp_path / name).write_bytes(buf.getvalue() + b" " * 2048)  # numpy reads its count, not the tail
        return tmp_path / name, lambda: reader(tmp_path / name)

    return case


def _read_counts(path):
    from timetotrain.data.loader import vocab_table

    vocab_table(path, 4)


def _read_empty_encodings(path):
    from timetotrain.data.flux_encodings import read_empty_arrays

    (path.parent / "clip_empty.npy").write_bytes((path.parent / "t5_empty.npy").read_bytes()[:-2048])
    read_empty_arrays(path.parent, None)


READERS = {
    "token-counts": _npy_over(_read_counts, "c4_token_counts.npy"),
    "empty-encodings": _npy_over(_read_empty_encodings, "t5_empty.npy"),
    "config": _over(_read_config, "c.toml", "seed = 1\n"),
    "manifest": _over(_read_manifest, "c4-train.manifest.json", "{}"),
    "base.json": _over(_read_base, "base.json", '{"weights_sha256": "0", "key": "k"}'),
    "rcp-file": _over(_read_rcp, "rcps.json", "{}"),
    "scaling.json": _over(_read_scaling, "scaling.json", '{"scaling_factor": 1.0}'),
    "system-json": _over(_read_system_json, "sys.json", "{}"),
    "download-metadata": _over(_read_metadata, "ds.uri", "http://example.invalid/ds\n"),
    "hf-config": _over(_read_hf_config, "config.json", "{}"),
    "hf-index": _over(_read_index, "model.safetensors.index.json", '{"weight_map": {}}'),
}


@pytest.mark.parametrize("what", list(READERS))
def test_a_file_a_user_names_is_read_with_a_bound(what, tmp_path, monkeypatch):
    """/dev/zero or a wrong file of gigabytes was read whole (`--config /dev/zero`: a MemoryError
    traceback): each reader stops at its bound with one line naming the file. The bound is set to 1 kB here,
    so the test writes 2 kB rather than 64 MiB."""
    from timetotrain import fileio

    monkeypatch.setattr(fileio, "SMALL_FILE", 1024)
    path, read = READERS[what](tmp_path)
    with pytest.raises(UserError) as e:
        read()
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "holds more than 1,024 bytes" in msg


def test_a_log_and_a_record_line_are_read_with_a_bound(tmp_path, monkeypatch):
    """The large bounds: a result log read whole (LARGE_FILE), a JSON-lines record line by line (LINE)."""
    from timetotrain import fileio
    from timetotrain.data import govreport
    from timetotrain.mlperf.results import parse_log

    monkeypatch.setattr(fileio, "LARGE_FILE", 1024)
    monkeypatch.setattr(fileio, "LINE", 1024)
    (tmp_path / "result_0.txt").write_bytes(_padded(":::MLLOG {}\n"))
    with pytest.raises(UserError, match=r"result_0.txt holds more than"):
        parse_log(tmp_path / "result_0.txt")
    (tmp_path / "g.jsonl").write_bytes(
        _padded('{"input": "report", "output": "summary"}').replace(b" ", b"x")
    )
    with pytest.raises(UserError, match=r"g.jsonl:1 is a line of more than"):
        list(govreport.iter_rows(tmp_path / "g.jsonl"))


def test_a_shard_member_is_read_with_a_bound(tmp_path, monkeypatch):
    """A WebDataset member is read whole into memory: one larger than any image or caption (a wrong shard,
    a hostile tar declaring gigabytes) is one line naming the shard and the member."""
    import tarfile

    from timetotrain.data import webdataset

    monkeypatch.setattr(webdataset, "MEMBER_LIMIT", 1024)
    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        info = tarfile.TarInfo("0001.jpg")
        info.size = 2048
        tar.addfile(info, io.BytesIO(b"x" * 2048))
    with pytest.raises(UserError, match=r"s.tar: member '0001.jpg' holds 2,048 bytes, more than any image"):
        list(webdataset.read_pairs([tmp_path / "s.tar"]))
