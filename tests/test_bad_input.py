"""Bad input, the way users and clusters produce it, across every command: each case is one line naming
the flag or file (`ttt: error: ...`, or argparse's usage error naming the flag), a non-zero exit, no
traceback, no result file, and no file changed anywhere, inputs included. All of them fail before
`init_start`, so each is timed in-process (torch is imported once, above) against a 5 s budget.

Most cases run `timetotrain.cli.main` in this process; the last test runs a few as real processes, to
show the same single line reaches a terminal."""

import dataclasses
import hashlib
import json
import re
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
import torch  # noqa: F401  (imported before the clock starts: the 5 s budget excludes it)
from conftest import require_file, shared_data_dir, ttt_command
from fakelogs import tier_log

from timetotrain.cli import main

BUDGET_S = 5.0


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]  # templates: {w} workspace, {c4} prepared C4, {tok} C4 of another tokenizer,
    # {src} the C4 json.gz folder, {gov} a GovReport .jsonl, {spm} the Llama 2 tokenizer.model
    names: str  # the flag or file the error line must name (a template too)
    also: tuple[str, ...] = ()  # more text the line must hold: what is wrong, or the fix
    usage: bool = False  # argparse's own usage error (exit 2, usage lines, then one error line)

    def needs(self, key: str) -> bool:
        return any("{" + key + "}" in a for a in self.argv)


def C(id, argv, names, *also, usage=False):
    return pytest.param(Case(id, tuple(argv.split()), names, also, usage), id=id)


def run_(*extra, data="{c4}"):
    return f"run llama31_8b --tier tiny --data {data} --logdir {{w}}/logs " + " ".join(extra)


SYNTH = "synth llama31_8b --logdir {w}/logs "
C4 = "data prepare c4 --src {src} --split train --out {w}/out "
GOV = "data prepare govreport --src {gov} --split train --tokenizer-model {spm} --out {w}/out "
PKG = "package --org o --system s --out {w}/pkg --results "

CASES = [
    # -- ttt run --
    C("run-data-missing", run_(data="{w}/nope"), "--data {w}/nope", "does not exist"),
    C("run-data-is-a-file", run_(data="{w}/afile"), "--data {w}/afile", "is a file, not a folder"),
    C("run-data-empty-folder", run_(data="{w}/empty"), "--data {w}/empty", "no train split"),
    C("run-data-wrong-tokenizer", run_(data="{tok}"), "{tok}/c4-train_text_document", "'llama2'", "llama3"),
    C(
        "run-data-of-another-benchmark",
        "run llama2_70b_lora --tier reference --data {c4} --logdir {w}/logs",
        "{c4}",
        "govreport",
    ),
    C(
        "run-tier-unknown",
        "run llama31_8b --tier huge --data {c4} --logdir {w}/logs",
        "--tier 'huge'",
        "tiny",
    ),
    C(
        "run-benchmark-unknown",
        "run resnet --tier tiny --data {c4} --logdir {w}/logs",
        "'resnet'",
        "ttt list",
    ),
    C("run-set-not-key-value", run_("--set lr"), "--set 'lr'", "key=value"),
    C("run-set-unknown-key", run_("--set lr_max=1"), "--set 'lr_max'", "choose from"),
    C(
        "run-set-gbs-not-divisible",
        run_("--set global_batch_size=24"),
        "global_batch_size=24",
        "micro_batch_size",
    ),
    C("run-set-not-a-number", run_("--set lr=fast"), "--set lr=fast", "expected a float"),
    C("run-set-non-finite", run_("--set target=inf"), "--set target=inf", "finite"),
    C("run-set-division", run_("--set division=semi"), "--set division='semi'", "closed or open"),
    C("run-set-warmup-too-long", run_("--set warmup_steps=5000"), "--set warmup_steps=5000", "max_steps"),
    C("run-max-steps-negative", run_("--max-steps -3"), "--max-steps -3", "positive"),
    C("run-runs-zero", run_("--runs 0"), "--runs 0", "at least 1"),
    C("run-seed-out-of-range", run_("--seed -1"), "--seed -1", "2**32"),
    C("run-seed-not-an-int", run_("--seed 1.5"), "--seed", "invalid int", usage=True),
    C(
        "run-logdir-is-a-file",
        "run llama31_8b --tier tiny --data {c4} --logdir {w}/afile",
        "--logdir {w}/afile",
        "not writable",
    ),
    C("run-parallel-garbage", run_("--parallel garbage"), "--parallel 'garbage'", "dp=8"),
    C("run-parallel-world-size", run_("--parallel dp=4"), "--parallel dp=4", "torchrun started 1"),
    C("run-precision-invalid", run_("--precision fp8"), "--precision", "invalid choice", usage=True),
    C("run-device-unknown", run_("--device tpu"), "--device 'tpu'", "cpu, cuda"),
    C(
        "run-init-checkpoint-a-file",
        run_("--init-checkpoint {w}/afile"),
        "--init-checkpoint {w}/afile",
        "not a folder",
    ),
    C(
        "run-init-checkpoint-empty",
        run_("--init-checkpoint {w}/empty"),
        "--init-checkpoint {w}/empty",
        "model.safetensors",
    ),
    C("run-dist-timeout-negative", run_("--dist-timeout -1"), "--dist-timeout -1", "positive"),
    C("run-abort-grace-nan", run_("--abort-grace nan"), "--abort-grace nan", ">= 0"),
    C(
        "run-data-flag-missing",
        "run llama31_8b --tier tiny --logdir {w}/logs",
        "--data",
        "required",
        usage=True,
    ),
    # -- ttt synth --
    C("synth-steps-zero", SYNTH + "--steps 0", "--steps 0", "at least 2"),
    C("synth-layers-zero", SYNTH + "--layers 0", "--layers 0", "positive"),
    C("synth-rgat-layers-not-its-hops", "synth rgat --logdir {w}/logs --layers 3", "--layers 3", "fanouts"),
    C("synth-micro-batch-not-dividing", SYNTH + "--micro-batch 5", "--micro-batch=5", "per-rank batch 16"),
    C("synth-micro-batch-zero", SYNTH + "--micro-batch 0", "--micro-batch=0", "per-rank batch 16"),
    C("synth-warmup-negative", SYNTH + "--warmup-steps -1", "--warmup-steps -1", ">= 0"),
    C("synth-benchmark-unknown", "synth resnet --logdir {w}/logs", "'resnet'", "ttt list"),
    C("synth-logdir-is-a-file", "synth llama31_8b --logdir {w}/afile", "--logdir {w}/afile", "not writable"),
    C("synth-expert-parallel-dense", SYNTH + "--parallel ep=2", "--parallel 'ep=2'", "data-parallel"),
    C("synth-set-gbs-zero", SYNTH + "--set global_batch_size=0", "--set global_batch_size=0", "positive"),
    # -- ttt data prepare --
    C("prepare-src-missing", "data prepare c4 --src {w}/nope --split train --out {w}/out", "--src {w}/nope"),
    C(
        "prepare-src-is-a-file",
        "data prepare c4 --src {w}/afile --split train --out {w}/out",
        "--src {w}/afile",
        "not a directory",
    ),
    C(
        "prepare-src-empty-folder",
        "data prepare c4 --src {w}/empty --split train --out {w}/out",
        "--src {w}/empty",
        "c4-train.*.json.gz",
    ),
    C(
        "prepare-src-not-gzip",
        "data prepare c4 --src {w}/badgz --split train --out {w}/out",
        "{w}/badgz/c4-train.00000-of-00001.json.gz",
        "gzip",
    ),
    C(
        "prepare-split-invalid",
        "data prepare c4 --src {src} --split test --out {w}/out",
        "--split",
        "invalid choice",
        usage=True,
    ),
    C("prepare-c4-block", C4 + "--block 8", "--block", "govreport` only"),
    C("prepare-c4-rows", C4 + "--rows 0:3", "--rows", "govreport` only"),
    C(
        "prepare-c4-llama2-without-model",
        C4 + "--tokenizer llama2",
        "--tokenizer llama2",
        "--tokenizer-model",
    ),
    C(
        "prepare-c4-wrong-tokenizer-model",
        C4 + "--tokenizer-model {spm}",
        "--tokenizer-model {spm}",
        "not the llama3 tokenizer",
    ),
    C("prepare-workers-zero", C4 + "--workers 0", "--workers 0", "at least 1"),
    C(
        "prepare-out-is-a-file",
        "data prepare c4 --src {src} --split train --out {w}/afile",
        "--out {w}/afile",
        "not writable",
    ),
    C(
        "prepare-govreport-no-tokenizer-model",
        "data prepare govreport --src {gov} --split train --out {w}/out",
        "--tokenizer-model",
        "Llama 2",
    ),
    C(
        "prepare-govreport-tokenizer-not-spm",
        "data prepare govreport --src {gov} --split train --tokenizer-model {w}/notes.txt --out {w}/out",
        "--tokenizer-model {w}/notes.txt",
        "SentencePiece",
    ),
    C("prepare-govreport-rows-syntax", GOV + "--rows a:b", "--rows 'a:b'", "START:STOP"),
    C("prepare-govreport-rows-empty", GOV + "--rows 5:2", "--rows '5:2'", "selects nothing"),
    C("prepare-govreport-no-eod", GOV + "--no-eod", "--no-eod", "c4 only"),
    C(
        "prepare-govreport-src-empty",
        "data prepare govreport --src {w}/empty.jsonl --split train --tokenizer-model {spm} --out {w}/out",
        "{w}/empty.jsonl",
        "no records",
    ),
    C(
        "prepare-govreport-src-not-json",
        "data prepare govreport --src {w}/garbage.jsonl --split train --tokenizer-model {spm} --out {w}/out",
        "{w}/garbage.jsonl:2",
        "not JSON",
    ),
    # -- ttt check --
    C("rules-build-benchmark-unknown", "rules build resnet --check", "'resnet'", "ttt list"),
    C("check-missing", "check {w}/nope.txt", "{w}/nope.txt", "not a file"),
    C("check-a-folder", "check {w}/empty", "{w}/empty", "not a file"),
    C("check-not-mlperf", "check {w}/notes.txt", "{w}/notes.txt", "no :::MLLOG lines"),
    C("check-empty-file", "check {w}/empty.txt", "{w}/empty.txt", "no :::MLLOG lines"),
    C(
        "check-unknown-benchmark",
        "check {w}/foo_ref/result_0.txt",
        "{w}/foo_ref/result_0.txt",
        "'foo'",
        "6.0.0",
    ),
    C(
        "check-unknown-benchmark-tier",
        "check {w}/foo_tiny/result_0.txt",
        "{w}/foo_tiny/result_0.txt",
        "not a timetotrain benchmark",
    ),
    C(
        "check-ruleset-unknown",
        "check {w}/logs_ok/result_0.txt --ruleset 9.9.9",
        "--ruleset '9.9.9'",
        "6.0.0",
    ),
    # -- ttt score --
    C("score-missing", "score {w}/nope", "{w}/nope", "not a directory"),
    C("score-empty-folder", "score {w}/empty", "{w}/empty", "no result_*.txt"),
    C("score-only-text-results", "score {w}/foreign", "{w}/foreign/result_0.txt", "no :::MLLOG lines"),
    C("score-unknown-benchmark", "score {w}/foo_tiny", "{w}/foo_tiny/result_0.txt", "'foo'"),
    C("score-ruleset-unknown", "score {w}/logs_ok --ruleset 9.9.9", "--ruleset '9.9.9'"),
    # -- ttt package --
    C("package-results-missing", PKG + "{w}/nope", "--results {w}/nope", "not a directory"),
    C(
        "package-out-exists",
        "package --org o --system s --results {w}/logs_ok --out {w}/empty",
        "--out {w}/empty",
        "already exists",
    ),
    C(
        "package-out-under-a-file",
        "package --org o --system s --results {w}/logs_ok --out {w}/afile/pkg",
        "--out {w}/afile/pkg",
    ),
    C("package-mixed-benchmarks", PKG + "{w}/mixed", "{w}/mixed/result_3.txt", "'gpt_oss_20b'"),
    C("package-not-mlperf-result", PKG + "{w}/foreign", "{w}/foreign/result_0.txt", "no :::MLLOG lines"),
    C("package-unknown-benchmark", PKG + "{w}/foo_tiny", "{w}/foo_tiny/result_0.txt", "'foo'"),
    C(
        "package-org-not-a-name",
        "package --org a/b --system s --results {w}/logs_ok --out {w}/pkg",
        "--org 'a/b'",
    ),
    C(
        "package-system-json-missing",
        PKG + "{w}/logs_ok --system-json {w}/nope.json",
        "--system-json {w}/nope.json",
    ),
    C("package-ruleset-unknown", PKG + "{w}/logs_ok --check --ruleset 9.9.9", "--ruleset '9.9.9'"),
    # -- ttt report --
    C("report-missing", "report {w}/nope --out {w}/rep", "{w}/nope", "not a directory"),
    C("report-empty-folder", "report {w}/empty --out {w}/rep", "{w}/empty", "no result_*.txt"),
    C("report-out-is-a-file", "report {w}/logs_ok --out {w}/afile", "--out {w}/afile"),
    C("report-unknown-benchmark", "report {w}/foo_ref --out {w}/rep", "{w}/foo_ref/result_0.txt", "'foo'"),
    C("report-ruleset-unknown", "report {w}/logs_ok --out {w}/rep --ruleset 9.9.9", "--ruleset '9.9.9'"),
    C("report-out-missing", "report {w}/logs_ok", "--out", "required", "--html"),
    C("report-html-is-a-folder", "report {w}/logs_ok --html {w}/empty", "--html {w}/empty", "a folder"),
    # -- ttt suite --
    C("suite-tier-unknown", "suite --tier huge --out {w}/s", "--tier 'huge'", "no benchmark"),
    C("suite-only-without-tier", "suite --tier huge --only llama31_8b --out {w}/s", "--only llama31_8b"),
    C("suite-only-unknown", "suite --tier tiny --only nope --out {w}/s", "'nope'", "ttt list"),
    C("suite-runs-zero", "suite --tier tiny --runs 0 --out {w}/s", "--runs 0"),
    C("suite-data-missing", "suite --tier tiny --data {w}/nope --out {w}/s", "--data {w}/nope"),
    # -- ttt data download --
    C(
        "download-c4-shards",
        "data download c4 --shards 9 --split validation --out {w}/dl",
        "--shards 9",
        "8 shards",
    ),
    C("download-mlcommons-no-metadata", "data download mlcommons --out {w}/dl", "--metadata"),
    C(
        "download-metadata-not-uri",
        "data download mlcommons --metadata {w}/afile --out {w}/dl",
        "--metadata",
        ".uri",
    ),
    # -- rgat: its data and `ttt data synth-graph` (broken graphs: tests/test_igbh.py) --
    C(
        "rgat-data-not-igbh",
        "run rgat --tier tiny --data {c4} --logdir {w}/logs",
        "--data {c4}",
        "synth-graph",
    ),
    C(
        "synth-graph-out-is-a-file",
        "data synth-graph --scale tiny --out {w}/afile",
        "--out {w}/afile",
        "is a file",
    ),
    C(
        "synth-graph-out-not-empty",
        "data synth-graph --scale tiny --out {w}/logs_ok",
        "--out {w}/logs_ok",
        "not empty",
    ),
    # -- the benchmarks added since: flux1, rgat, deepseekv3_671b and llama31_405b, their data and rules --
    C(
        "flux1-data-not-encodings",
        "run flux1 --tier tiny --data {c4} --logdir {w}/logs",
        "--data {c4}",
        "ttt data prepare flux",
    ),
    C(
        "flux1-data-is-a-file",
        "run flux1 --tier tiny --data {w}/afile --logdir {w}/logs",
        "--data {w}/afile",
        "not a folder",
    ),
    C(
        "flux1-closed-gbs-without-rcp",
        "run flux1 --tier reference --data {w}/empty --logdir {w}/logs --set global_batch_size=768",
        "global_batch_size=768",
        "MLPerf Training rules",
        "--set division=open",
    ),
    C("flux1-synth-steps-one", "synth flux1 --logdir {w}/logs --steps 1", "--steps 1", "at least 2"),
    C(
        "prepare-flux-no-encoders",
        "data prepare flux --src {w}/empty --split train --out {w}/out",
        "--encoders",
        "standin",
    ),
    C(
        "prepare-flux-src-without-tars",
        "data prepare flux --src {w}/empty --split train --encoders standin --tokenizer-model {spm} --out {w}/out",
        "--src {w}/empty",
        "no .tar shards",
    ),
    C(
        "prepare-flux-tar-without-samples",
        "data prepare flux --src {w}/empty.tar --split train --encoders standin --tokenizer-model {spm} --out {w}/out",
        "--src {w}/empty.tar",
        "no train samples",
    ),
    C(
        "rgat-closed-target",
        "run rgat --tier reference --data {w}/empty --logdir {w}/logs --set target=0.7",
        "--set division=open",
        "quality target is fixed",
    ),
    C(
        "rgat-data-missing",
        "run rgat --tier tiny --data {w}/nope --logdir {w}/logs",
        "--data {w}/nope",
        "synth-graph",
    ),
    C(
        "deepseekv3-tiny-without-its-base",
        "run deepseekv3_671b --tier tiny --data {c4} --logdir {w}/logs",
        "--init-checkpoint",
        "ttt base deepseekv3_671b --tier tiny",
    ),
    C(
        "deepseekv3-closed-gbs-without-rcp",
        "run deepseekv3_671b --tier reference --data {w}/empty --logdir {w}/logs --set global_batch_size=17408 "
        "--set lr=2.4739e-05",  # the LR its yaml computes for this GBS: the warmup is still nobody's choice
        "global_batch_size=17408",
        "RCPs at 15360, 16384, 18432",
        "--set warmup_steps=...",
    ),
    C(
        "deepseekv3-synth-expert-parallel-one-process",
        "synth deepseekv3_671b --logdir {w}/logs --parallel ep=2,dp=2",
        "--parallel ep=2,dp=2",
        "torchrun started 1",
    ),
    C(
        "llama31_405b-base-not-a-checkpoint",
        "run llama31_405b --tier tiny --data {c4} --logdir {w}/logs --init-checkpoint {w}/empty",
        "--init-checkpoint {w}/empty",
        "model.safetensors",
    ),
    C(
        "llama31_405b-closed-end-lr",
        "run llama31_405b --tier reference --data {w}/empty --logdir {w}/logs --set end_lr=1e-6",
        "--set end_lr",
        "0.01 x the base LR",
    ),
    C(
        "llama31_405b-synth-tensor-parallel-one-process",
        "synth llama31_405b --logdir {w}/logs --parallel tp=2",
        "--parallel tp=2",
        "torchrun started 1",
    ),
]


def _workspace(w: Path) -> None:
    """Every input the cases point at: stray files, empty folders, damaged sources, result logs."""
    w.mkdir()
    (w / "afile").write_text("x\n")
    (w / "empty").mkdir()
    (w / "notes.txt").write_text("training went fine\nloss 2.31 at step 10\n")
    (w / "empty.txt").write_text("")
    (w / "empty.jsonl").write_text("")
    tarfile.open(w / "empty.tar", "w").close()  # a valid tar that holds no sample
    (w / "garbage.jsonl").write_text('{"id": "a", "input": "report", "output": "summary"}\nnot json\n')
    (w / "badgz").mkdir()
    (w / "badgz" / "c4-train.00000-of-00001.json.gz").write_bytes(b"not gzip")
    for i in range(3):
        tier_log(w / "logs_ok" / f"result_{i}.txt", 10 + i, 640, 2.0)
    (w / "foreign").mkdir()
    (w / "foreign" / "result_0.txt").write_text("epoch 1 loss 3.2\n")
    for i in range(3):
        tier_log(w / "mixed" / f"result_{i}.txt", 20 + i, 640, 2.0)
    tier_log(w / "mixed" / "result_3.txt", 23, 640, 2.0, benchmark="gpt_oss_20b")
    text = (w / "logs_ok" / "result_0.txt").read_text().replace('"value": "llama31_8b"', '"value": "foo"')
    (w / "foo_tiny").mkdir()
    (w / "foo_tiny" / "result_0.txt").write_text(text)
    (w / "foo_ref").mkdir()  # no ttt_tier: a reference log, judged by the official ruleset
    (w / "foo_ref" / "result_0.txt").write_text(
        "".join(ln + "\n" for ln in text.splitlines() if "ttt_tier" not in ln)
    )


@pytest.fixture(scope="module")
def other_tokenizer_data(c4_prepared, tmp_path_factory) -> Path:
    """The prepared C4 with manifests that say another tokenizer made it (as data of `--tokenizer llama2`)."""
    dst = tmp_path_factory.mktemp("c4tok") / "c4"
    shutil.copytree(c4_prepared, dst)
    for m in dst.glob("*.manifest.json"):
        doc = json.loads(m.read_text())
        doc["tokenizer"].update(name="llama2", vocab_size=32000)
        m.write_text(json.dumps(doc))
    return dst


def _snapshot(*roots: Path) -> dict[str, tuple]:
    """Every path under the roots: folders by name, files by size, mtime and content."""
    out = {}
    for root in roots:
        for p in sorted([root, *root.rglob("*")]):
            if p.is_dir():
                out[str(p)] = ("dir",)
            else:
                st = p.stat()
                out[str(p)] = (st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def _paths(case: Case, request, w: Path) -> dict[str, str]:
    paths = {"w": str(w)}
    if case.needs("c4") or case.needs("tok"):
        paths["c4"] = str(request.getfixturevalue("c4_prepared"))
    if case.needs("tok"):
        paths["tok"] = str(request.getfixturevalue("other_tokenizer_data"))
    if case.needs("src"):
        paths["src"] = str(request.getfixturevalue("c4_src"))
    if case.needs("gov"):
        paths["gov"] = str(
            require_file(shared_data_dir() / "govreport" / "gov_report.validation.scrolls_format.jsonl")
        )
    if case.needs("spm"):
        paths["spm"] = str(require_file(shared_data_dir() / "tokenizers" / "llama2" / "tokenizer.model"))
    return paths


def _under(path: Path, folders: list[Path]) -> bool:
    return any(path == f or f in path.parents for f in folders)


def _error_line(case: Case, err: str) -> str:
    """The one error line of stderr, with everything else on stderr accounted for."""
    lines = err.strip().splitlines()
    errors = [ln for ln in lines if re.match(r"ttt( [a-z ]+)?: error: ", ln)]
    assert len(errors) == 1, err
    if case.usage:  # argparse: the usage (which may wrap), then its error line last
        assert lines[0].startswith("usage: ttt") and lines[-1] == errors[0], err
    else:
        assert lines == errors, err  # nothing but the line: no warning, no note, no traceback
    return errors[0]


@pytest.mark.parametrize("case", CASES)
def test_bad_input(case: Case, request, tmp_path, capsys):
    w = tmp_path / "w"
    _workspace(w)
    paths = _paths(case, request, w)
    argv = [a.format(**paths) for a in case.argv]
    inputs = [w] + [Path(paths[k]) for k in ("c4", "tok") if k in paths]
    before = _snapshot(*inputs)
    capsys.readouterr()  # what fixtures printed while preparing data

    t0 = time.monotonic()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    seconds = time.monotonic() - t0
    err = capsys.readouterr().err

    assert "Traceback" not in err
    assert code == 2, f"exit {code}: {err}"
    line = _error_line(case, err)
    for needle in (case.names, *case.also):
        assert needle.format(**paths) in line, line
    assert seconds < BUDGET_S, f"{seconds:.2f} s to fail"
    assert not [p for p in w.rglob("result_*") if str(p) not in before], "a result file was written"
    after = _snapshot(*inputs)
    # The one thing allowed: folders made for --out/--logdir before the check that failed.
    outputs = [Path(argv[i + 1]) for i, a in enumerate(argv[:-1]) if a in ("--out", "--logdir")]
    made = {p for p in after.keys() - before.keys() if after[p] == ("dir",) and _under(Path(p), outputs)}
    assert {p: v for p, v in after.items() if p not in made} == before, "a file changed"


@pytest.mark.parametrize(
    "argv,needle",
    [
        (
            [
                "data",
                "prepare",
                "c4",
                "--src",
                "{w}",
                "--split",
                "train",
                "--out",
                "{w}/out",
                "--workers",
                "0",
            ],
            "--workers 0",
        ),
        (["check", "{w}/notes.txt"], "{w}/notes.txt"),
        (
            ["package", "--org", "o", "--system", "s", "--results", "{w}/logs_ok", "--out", "{w}/afile/pkg"],
            "--out",
        ),
    ],
)
def test_a_real_process_prints_one_line(tmp_path, argv, needle):
    """What a terminal gets: exactly the one line on stderr, nothing on stdout, exit 2."""
    w = tmp_path / "w"
    _workspace(w)
    argv = [a.format(w=w) for a in argv]
    proc = subprocess.run(ttt_command(*argv), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("ttt: error: "), proc.stderr
    assert needle.format(w=w) in proc.stderr


def test_the_suite_covers_every_command():
    commands = {
        c.values[0].argv[0] + (" " + c.values[0].argv[1] if c.values[0].argv[0] == "data" else "")
        for c in CASES
    }
    assert commands == {"run", "synth", "data prepare", "data synth-graph", "check", "score", "package",
                        "report", "suite", "data download", "rules"}  # fmt: skip
    assert len(CASES) >= 40
