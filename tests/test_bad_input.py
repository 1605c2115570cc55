"""Bad input, the way users and clusters produce it, across every command: each case is one line naming
the flag or file (`ttt: error: ...`, or argparse's usage error naming the flag), a non-zero exit, no
traceback, no result file, and no file changed anywhere, inputs included. All of them fail before
`init_start`, so each is timed in-process (torch is imported once, above) against a 5 s budget.

Most cases run `timetotrain.cli.main` in this process; the last test runs a few as real processes, to
show the same single line reaches a terminal."""

import dataclasses
import errno
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch  # noqa: F401  (imported before the clock starts: the 5 s budget excludes it)
from conftest import require_file, shared_data_dir, ttt_command
from fakelogs import tier_log

from timetotrain.cli import main

pytestmark = pytest.mark.bad_input

BUDGET_S = 5.0


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]  # templates: {w} workspace, {c4} prepared C4, {tok} C4 of another tokenizer,
    # {src} the C4 json.gz folder, {gov} a GovReport .jsonl, {spm} the Llama 2 tokenizer.model, {mixtral}
    # the Mixtral 8x22B one
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
    C("run-config-dev-zero", run_("--config /dev/zero"), "--config /dev/zero", "more than 64 MiB"),
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
    C("run-precision-invalid", run_("--precision fp4"), "--precision", "invalid choice", usage=True),
    C("run-fp8-recipe-unknown", run_("--precision fp8 --set fp8_recipe=mx"), "fp8_recipe=mx", "rowwise"),
    C(
        "run-fp8-recipe-without-fp8",
        run_("--set fp8_recipe=rowwise"),
        "fp8_recipe=rowwise",
        "--precision fp8",
    ),
    C(
        "run-fp8-moe-on-cpu",
        "run gpt_oss_20b --tier tiny --data {c4} --logdir {w}/logs --precision fp8",
        "--precision fp8",
        "_scaled_grouped_mm",
        "bf16",
    ),
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
        "prepare-c4-text-a-number",
        "data prepare c4 --src {w}/numgz --split train --out {w}/out",
        "{w}/numgz/c4-train.00000-of-00001.json.gz:2",
        "`text` field is a number (5), not a string",
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
    C(
        "prepare-govreport-mixtral-tokenizer",
        "data prepare govreport --src {gov} --split train --tokenizer-model {mixtral} --out {w}/out",
        "--tokenizer-model {mixtral}",
        "the Mixtral 8x22B tokenizer",
        "Llama 2 tokenizer.model",
    ),
    C(
        "prepare-govreport-empty-summary",
        "data prepare govreport --src {w}/empty_summary.jsonl --split train --tokenizer-model {spm} --out {w}/out",
        "{w}/empty_summary.jsonl:2",
        "empty `output` field",
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
        # without the flag the tier loads its shipped base (tests/test_shipped_bases.py)
        "deepseekv3-tiny-base-not-a-folder",
        "run deepseekv3_671b --tier tiny --data {c4} --logdir {w}/logs --init-checkpoint {w}/nope",
        "--init-checkpoint {w}/nope",
        "is not a folder",
    ),
    C(
        # any GBS from the floor takes the rules' LR (tests/test_reference_diff.py); one below it is refused
        "deepseekv3-closed-gbs-below-the-floor",
        "run deepseekv3_671b --tier reference --data {w}/empty --logdir {w}/logs --set global_batch_size=8192",
        "global_batch_size=8192",
        ">= 15360",
    ),
    C(
        "deepseekv3-closed-lr-not-the-rules",
        "run deepseekv3_671b --tier reference --data {w}/empty --logdir {w}/logs --set global_batch_size=17408 "
        "--set lr=3e-5",  # the rules fix LR = 2.4e-5 * sqrt(GBS / 16384) at every GBS
        "opt_base_learning_rate=3e-05",
        "2.4e-05 * (s['global_batch_size'] / 16384) ** 0.5",
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
        "llama31_405b-gbs-whose-rule-lr-is-below-the-end-lr",
        "run llama31_405b --tier reference --data {w}/empty --logdir {w}/logs --set global_batch_size=8",
        "--set global_batch_size=8",
        "below the end LR 8e-07",
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
    (w / "empty_summary.jsonl").write_text(
        '{"id": "a", "input": "report", "output": "summary"}\n{"id": "b", "input": "report", "output": " "}\n'
    )
    (w / "badgz").mkdir()
    (w / "badgz" / "c4-train.00000-of-00001.json.gz").write_bytes(b"not gzip")
    (w / "numgz").mkdir()
    (w / "numgz" / "c4-train.00000-of-00001.json.gz").write_bytes(
        gzip.compress(b'{"text": "a real document"}\n{"text": 5, "url": "u"}\n')
    )
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
    if case.needs("mixtral"):
        paths["mixtral"] = str(
            require_file(shared_data_dir() / "tokenizers" / "mixtral-8x22b" / "tokenizer.model")
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


@pytest.mark.slow
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


# --- issue 22: checks before trust ---
# Damaged or mismatched inputs that used to give a traceback or be accepted: each is one `ttt: error:` line,
# exit 2, nothing final written, the inputs unchanged (the harness of `test_bad_input` above, with the
# workspace below added). A full disk is simulated as in tests/test_faults.py, in process: here every
# file `fileio` opens for writing (Staged and atomic_write, so every writer of ttt's outputs) fails with
# ENOSPC once a byte budget is spent.


def flip_byte(path: Path, at: int = -1) -> None:
    """One byte changed in place, the size kept: only a checksum can tell."""
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def trust_graph(tmp_path_factory) -> Path:
    """The rgat tiny tier's generated graph (`ttt data synth-graph --scale tiny`), its CSC cache built."""
    from timetotrain.data import graph_synth, igbh

    out = tmp_path_factory.mktemp("graph") / "g"
    graph_synth.generate(out, graph_synth.SCALES["tiny"], seed=0, log=lambda s: None)
    igbh.build_csc(igbh.check_layout(out), log=lambda s: None)
    return out


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares width x height RGB pixels and holds none: what a decompression bomb shows PIL
    before it decodes anything."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    )


def tar_of(path: Path, members: dict[str, bytes]) -> None:
    import io

    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def gov_of_mixtral(tmp_path_factory) -> Path:
    """GovReport blocks whose manifests say the Mixtral tokenizer made them (as one made with
    `--tokenizer-model` of Mixtral's tokenizer.model would)."""
    from timetotrain.data import govreport

    src = require_file(shared_data_dir() / "govreport" / "gov_report.validation.scrolls_format.jsonl")
    spm = require_file(shared_data_dir() / "tokenizers" / "llama2" / "tokenizer.model")
    out = tmp_path_factory.mktemp("gov") / "gov"
    govreport.prepare_tiny(src, spm, out)
    for m in out.glob("*.manifest.json"):
        doc = json.loads(m.read_text())
        doc["tokenizer"]["name"] = "mixtral"
        m.write_text(json.dumps(doc))
    return out


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory) -> Path:
    """llama31_8b tiny's freshly initialised weights as a Hugging Face folder (model.safetensors, config.json)."""
    from safetensors.torch import save_file

    from timetotrain.spec.registry import get

    bench = get("llama31_8b")
    cfg = bench.tier("tiny").model
    model = bench.family.build(cfg)
    state, config = bench.family.hf_export(model.state_dict(), cfg)
    out = tmp_path_factory.mktemp("hf") / "hf"
    out.mkdir()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


def _hf_variant(
    src: Path, dst: Path, tensor=None, config=None, name: str = "model.layers.0.mlp.down_proj.weight"
) -> None:
    """A copy of `src` with one tensor changed (`tensor(name, t)` returns the new one) or its config.json
    text replaced."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if tensor is not None:
        state = load_file(src / "model.safetensors")
        state[name] = tensor(state[name])
        save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        (dst / "config.json").write_text(config(json.loads((src / "config.json").read_text())))


def _nan_at(t, where):
    t = t.clone()
    t.view(-1)[where] = float("nan")
    return t


def _graph(request, w: Path, name: str, change) -> None:
    from timetotrain.data import igbh

    shutil.copytree(request.getfixturevalue("trust_graph"), w / name)
    change(w / name, igbh)


def _cut_csc(d: Path, igbh) -> None:
    victim = sorted((d / igbh.CACHE).glob("*.indices.npy"))[0]
    os.truncate(victim, victim.stat().st_size // 2)  # a copy of the data folder cut short


def _float_labels(d: Path, igbh) -> None:
    labels = d / "paper" / igbh.LABEL_FILE
    np.save(labels, np.load(labels).astype(np.float32))


def _inf_feature(d: Path, igbh) -> None:
    feats = d / "author" / igbh.FEAT_FILE
    f = np.load(feats)
    f[17, 3] = np.inf
    np.save(feats, f)


def _flux_nan(w: Path) -> None:
    """One train split of flux1 tiny's shapes (the scan comes after the shape check), its T5 states NaN."""
    from timetotrain.data import flux_encodings as enc
    from timetotrain.spec.registry import get
    from timetotrain.tasks.rectified_flow import shapes_of

    shapes = shapes_of(get("flux1").tier("tiny").model)
    arrays = {f: enc.to_numpy(torch.zeros(3, *shapes.of(f)), "bfloat16") for f in enc.FIELDS}
    arrays["t5"] = enc.to_numpy(torch.full((3, *shapes.t5), float("nan")), "bfloat16")
    meta = {"dtypes": dict.fromkeys(enc.FIELDS, "bfloat16")}
    enc.write_split(w / "flux_nan", "train", ["a", "b", "c"], arrays, meta)


def _gov_float_labels(w: Path, request) -> None:
    """GovReport blocks whose labels are floats, with a manifest that vouches for them."""
    from timetotrain.data import govreport
    from timetotrain.data.manifest import sha256_file

    d = w / "gov_float_labels"
    shutil.copytree(request.getfixturevalue("gov_of_mixtral"), d)
    labels = d / govreport.array_names("train")[1]
    np.save(labels, np.load(labels).astype(np.float32))
    man = d / f"{govreport.dataset_name('train')}.manifest.json"
    doc = json.loads(man.read_text())
    doc["files"][labels.name] = {"bytes": labels.stat().st_size, "sha256": sha256_file(labels)}
    man.write_text(json.dumps(doc))


def _flux_flipped(w: Path) -> None:
    from test_flux_task import CFG, write_dataset

    write_dataset(w / "flux_flipped", CFG, n_train=4, n_val=2)
    flip_byte(w / "flux_flipped" / "train" / "clip.npy")


def _safetensors(w: Path, name: str) -> None:
    from safetensors.torch import save_file

    (w / name).mkdir()
    f = w / name / "model.safetensors"
    save_file({"w": torch.ones(64)}, f)
    if name == "st_truncated":
        os.truncate(f, f.stat().st_size - 16)  # a download cut short
    else:
        raw = bytearray(f.read_bytes())
        raw[12:20] = b"\xff" * 8  # inside the JSON header
        f.write_bytes(bytes(raw))


def _flux_manifest(w: Path, name: str, text: str) -> None:
    (w / name / "train").mkdir(parents=True)
    (w / name / "train" / "manifest.json").write_text(text)


def _bomb(w: Path, name: str, side: int) -> None:
    tar_of(w / f"{name}.tar", {"s0.png": png_header_only(side, side), "s0.txt": b"a caption"})


# What each issue-22 input is made by, by its name under {w}: a case gets only the ones its argv names.
_TRUST_INPUTS = {
    "st_truncated": lambda w, r: _safetensors(w, "st_truncated"),
    "st_garbled": lambda w, r: _safetensors(w, "st_garbled"),
    "suite_bad": lambda w, r: (
        (w / "suite_bad").mkdir(),  # a suite state whose seeds are a list, not benchmark -> seeds
        (w / "suite_bad" / "suite.json").write_text('{"tier": "tiny", "seeds": [1, 2], "seconds": {}}\n'),
    ),
    "synth_bad": lambda w, r: (
        (w / "synth_bad").mkdir(),  # names a benchmark and an MFU, but the MFU is a word
        (w / "synth_bad" / "summary_0.json").write_text('{"benchmark": "llama31_8b", "tier": "tiny", "mfu": "high"}'),
    ),
    "graph_csc_cut": lambda w, r: _graph(r, w, "graph_csc_cut", _cut_csc),
    "graph_flipped": lambda w, r: _graph(r, w, "graph_flipped", lambda d, igbh: flip_byte(d / "paper" / igbh.FEAT_FILE)),
    "graph_float_labels": lambda w, r: _graph(r, w, "graph_float_labels", _float_labels),
    "graph_nan_features": lambda w, r: _graph(r, w, "graph_nan_features", _inf_feature),
    "hf_int32": lambda w, r: _hf_variant(r.getfixturevalue("hf_tiny"), w / "hf_int32", tensor=lambda t: (t * 100).to(torch.int32)),
    # found by the bounded scan (test_a_nan_past_the_bounded_scan_is_refused_at_load: one past it)
    "hf_nan_first": lambda w, r: _hf_variant(r.getfixturevalue("hf_tiny"), w / "hf_nan_first", tensor=lambda t: _nan_at(t, 0)),
    "hf_config_not_json": lambda w, r: _hf_variant(r.getfixturevalue("hf_tiny"), w / "hf_config_not_json", config=lambda c: "{hidden_size: 128"),
    "hf_config_heads": lambda w, r: _hf_variant(
        r.getfixturevalue("hf_tiny"), w / "hf_config_heads", config=lambda c: json.dumps({**c, "num_attention_heads": 1})
    ),
    "flux_nan": lambda w, r: _flux_nan(w),
    "flux_flipped": lambda w, r: _flux_flipped(w),
    "flux_not_json": lambda w, r: _flux_manifest(w, "flux_not_json", "{samples: 3"),
    "flux_samples_a_word": lambda w, r: _flux_manifest(w, "flux_samples_a_word", '{"samples": "many", "fields": {}}'),
    "flux_dtype_unknown": lambda w, r: _flux_manifest(w, "flux_dtype_unknown", '{"samples": 1, "fields": {"t5": {"dtype": "int4"}}}'),
    "gov_mixtral": lambda w, r: shutil.copytree(r.getfixturevalue("gov_of_mixtral"), w / "gov_mixtral"),
    "gov_float_labels": _gov_float_labels,
    # Over PIL's hard limit (2 x MAX_IMAGE_PIXELS), and in the band where PIL only warns and decodes.
    "bomb.tar": lambda w, r: _bomb(w, "bomb", 30_000),
    "bomb_warned.tar": lambda w, r: _bomb(w, "bomb_warned", 10_000),
}  # fmt: skip


def _trust_workspace(w: Path, case: Case, request) -> None:
    """What the issue-22 cases point at, beside `_workspace`'s files: only what this case names."""
    named = {a.split("/")[1] for a in case.argv if a.startswith("{w}/")}
    for name in named & _TRUST_INPUTS.keys():
        _TRUST_INPUTS[name](w, request)


TRUST_CASES = [
    C(
        "damaged-safetensors-truncated",
        run_("--init-checkpoint {w}/st_truncated", data="{w}/empty"),
        "{w}/st_truncated/model.safetensors",
        "truncated",
    ),
    C(
        "damaged-safetensors-garbled-header",
        run_("--init-checkpoint {w}/st_garbled", data="{w}/empty"),
        "{w}/st_garbled/model.safetensors",
        "unreadable header",
    ),
    C("synth-graph-seed-negative", "data synth-graph --scale tiny --seed -1 --out {w}/g", "--seed -1"),
    C(
        "synth-graph-out-under-a-file",
        "data synth-graph --scale tiny --out {w}/afile/g",
        "--out {w}/afile/g",
        "nothing was written",
    ),
    C(
        "report-html-into-a-missing-folder",
        "report {w}/logs_ok --html {w}/nope/r.html",
        "--html {w}/nope/r.html",
        "No such file",
    ),
    C(
        "suite-state-wrong-types",
        "suite --tier tiny --out {w}/suite_bad",
        "{w}/suite_bad/suite.json",
        "`seeds`",
    ),
    C(
        "report-synth-summary-wrong-types",
        "report {w}/synth_bad --html {w}/r.html",
        "{w}/synth_bad/summary_0.json",
        "`mfu` is 'high'",
    ),
    C(
        "rgat-csc-cache-truncated",
        "run rgat --tier tiny --data {w}/graph_csc_cut --logdir {w}/logs",
        "{w}/graph_csc_cut/ttt_csc/",
        "graph cache is damaged",
    ),
    C(
        "rgat-graph-checksum",
        "run rgat --tier tiny --data {w}/graph_flipped --logdir {w}/logs",
        "{w}/graph_flipped/paper/node_feat.npy checksum mismatch",
    ),
    C(
        "flux1-encodings-checksum",
        "run flux1 --tier tiny --data {w}/flux_flipped --logdir {w}/logs",
        "{w}/flux_flipped/train/clip.npy checksum mismatch",
    ),
    C(
        "flux1-manifest-not-json",
        "run flux1 --tier tiny --data {w}/flux_not_json --logdir {w}/logs",
        "{w}/flux_not_json/train/manifest.json",
        "unreadable",
    ),
    C(
        "flux1-manifest-samples-a-word",
        "run flux1 --tier tiny --data {w}/flux_samples_a_word --logdir {w}/logs",
        "{w}/flux_samples_a_word/train/manifest.json",
        "`samples` is 'many'",
    ),
    C(
        "flux1-manifest-dtype-unknown",
        "run flux1 --tier tiny --data {w}/flux_dtype_unknown --logdir {w}/logs",
        "{w}/flux_dtype_unknown/train/manifest.json",
        "`fields.t5.dtype`",
    ),
    C(
        "llama2_70b_lora-govreport-of-another-tokenizer",
        "run llama2_70b_lora --tier reference --data {w}/gov_mixtral --logdir {w}/logs",
        "{w}/gov_mixtral/govreport-train.manifest.json",
        "'mixtral'",
        "needs 'llama2'",
    ),
    C(
        "prepare-flux-decompression-bomb",
        "data prepare flux --src {w}/bomb.tar --split train --encoders standin --tokenizer-model {spm} --out {w}/out",
        "{w}/bomb.tar: member s0.png",
        "decompression bomb",
    ),
    C(
        "prepare-flux-decompression-bomb-pil-only-warns",
        "data prepare flux --src {w}/bomb_warned.tar --split train --encoders standin --tokenizer-model {spm} "
        "--out {w}/out",
        "{w}/bomb_warned.tar: member s0.png",
        "decompression bomb",
    ),
    C(
        "init-checkpoint-int32-weights",
        run_("--init-checkpoint {w}/hf_int32", data="{w}/empty"),
        "{w}/hf_int32/model.safetensors: tensor model.layers.0.mlp.down_proj.weight is I32",
        "not floating point",
    ),
    C(
        "init-checkpoint-nan-weights",
        run_("--init-checkpoint {w}/hf_nan_first", data="{w}/empty"),
        "{w}/hf_nan_first/model.safetensors: tensor model.layers.0.mlp.down_proj.weight holds NaN",
        "bounded scan",
    ),
    C(
        "init-checkpoint-config-not-json",
        run_("--init-checkpoint {w}/hf_config_not_json", data="{w}/empty"),
        "{w}/hf_config_not_json/config.json is not valid JSON",
    ),
    C(
        "init-checkpoint-config-of-another-head-split",
        run_("--init-checkpoint {w}/hf_config_heads", data="{w}/empty"),
        "{w}/hf_config_heads/config.json: num_attention_heads is 1",
        "n_heads=",
    ),
    C(
        "rgat-float-labels",
        "run rgat --tier tiny --data {w}/graph_float_labels --logdir {w}/logs",
        "{w}/graph_float_labels/paper/node_label_2K.npy holds float32 labels",
    ),
    C(
        "rgat-inf-features",
        "run rgat --tier tiny --data {w}/graph_nan_features --logdir {w}/logs",
        "{w}/graph_nan_features/author/node_feat.npy: row 17 holds NaN or inf",
        "full scan",
    ),
    C(
        "flux1-nan-encodings",
        "run flux1 --tier tiny --data {w}/flux_nan --logdir {w}/logs",
        "{w}/flux_nan/train/t5.npy: row 0 holds NaN or inf",
        "full scan",
    ),
    C(
        "llama2_70b_lora-float-labels",
        "run llama2_70b_lora --tier reference --data {w}/gov_float_labels --logdir {w}/logs",
        "{w}/gov_float_labels/",
        "holds float32 values, not token ids",
    ),
    C("plan-gpu-mem-nan", "plan llama31_8b --gpus 8 --gpu-mem nan", "--gpu-mem nan", "finite"),
    C("plan-gpu-mem-inf", "plan llama31_8b --gpus 8 --gpu-mem inf", "--gpu-mem inf", "finite"),
    C("plan-gpus-a-billion", "plan llama31_8b --gpus 1000000000 --gpu-mem 80", "--gpus 1000000000", "split"),
    C("plan-gpus-zero", "plan llama31_8b --gpus 0 --gpu-mem 80", "--gpus 0", "at least 1"),
    C(
        "plan-tp-not-dividing",
        "plan llama31_405b --gpus 3 --gpu-mem 80 --parallel tp=3",
        "tp=3",
        "divide by 3",
    ),
    C(
        "plan-parallel-not-the-gpus",
        "plan llama31_8b --gpus 8 --gpu-mem 80 --parallel dp=4",
        "dp=4",
        "--gpus",
    ),
    C("plan-parallel-garbage", "plan llama31_8b --gpus 8 --gpu-mem 80 --parallel tp=two", "'tp=two'", "dp=8"),
    C(
        "plan-batch-does-not-split",
        "plan llama31_8b --gpus 3 --gpu-mem 80 --parallel fsdp=3",
        "global_batch_size",
        "not divisible by 3 data-parallel ranks",
    ),
]


@pytest.mark.parametrize("case", TRUST_CASES)
def test_checks_before_trust(case: Case, request, tmp_path, capsys, monkeypatch):
    """`test_bad_input` itself, on a workspace with the damaged inputs of these cases."""
    this = sys.modules[__name__]
    base = this._workspace
    monkeypatch.setattr(this, "_workspace", lambda w: (base(w), _trust_workspace(w, case, request)))
    test_bad_input(case, request, tmp_path, capsys)


def test_plan_and_run_read_parallel_through_one_parser(monkeypatch, tmp_path):
    """`ttt plan --parallel` is `ttt run --parallel`: the same `parallel.parse`, so fsdp=4,tp=2 keeps tp=2."""
    from timetotrain.spec.registry import get
    from timetotrain.train import memory, parallel, prepare

    seen = []
    real = parallel.parse

    def spy(spec, world, *a, **k):
        seen.append((spec, world))
        return real(spec, world, *a, **k)

    monkeypatch.setattr(parallel, "parse", spy)
    bench = get("llama31_405b")
    tier = bench.tier("reference")
    _, rows, _ = memory.plan(bench, tier, 8, 80, "fsdp=4,tp=2")
    assert seen == [("fsdp=4,tp=2", 8)]
    assert rows and {r.parallel for r in rows} == {"tp=2,fsdp=4"}
    monkeypatch.setenv("WORLD_SIZE", "8")  # what torchrun sets for `ttt run`
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    prep = prepare.preflight(bench, tier, tmp_path, "fsdp=4,tp=2", "bf16", True, False, device="cpu")
    assert seen[-1] == ("fsdp=4,tp=2", 8) and (prep.plan.tp, prep.plan.fsdp) == (2, 4)


class _FullDisk:
    """A file whose writes fail with ENOSPC: the disk filled up before it."""

    def __init__(self, f):
        self._f = f

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def full_disk_from(monkeypatch, nth: int) -> None:
    """The disk is full from the `nth` file `fileio` opens for writing on (1-based): the ones before are
    written whole, so "nothing final written" is tested against outputs that did get written."""
    from timetotrain import fileio

    opened = [0]

    def opener(file, mode="r", *args, **kwargs):
        f = open(file, mode, *args, **kwargs)
        if "w" not in mode:
            return f
        opened[0] += 1
        return f if opened[0] < nth else _FullDisk(f)

    monkeypatch.setattr(fileio, "open", opener, raising=False)  # the name `fileio` resolves `open` by


@pytest.mark.parametrize(
    "argv,flag,nth",
    [
        # after the first feature files: the graph's files appear together or not at all
        ("data synth-graph --scale tiny --out {w}/g", "--out {w}/g", 3),
        ("report {w}/logs_ok --out {w}/rep", "--out {w}/rep", 2),  # summary.md, after the plot
        ("report {w}/logs_ok --html {w}/r.html", "--html {w}/r.html", 1),
        # the systems json, then (3) a copied result: the package is built aside and renamed
        ("package --org O --system S --results {w}/logs_ok --out {w}/pkg", "--out {w}/pkg", 1),
        ("package --org O --system S --results {w}/logs_ok --out {w}/pkg", "--out {w}/pkg", 3),
    ],
    ids=["synth-graph", "report", "report-html", "package-systems-json", "package-result-copy"],
)
def test_full_disk_is_one_line_and_writes_nothing(argv, flag, nth, tmp_path, capsys, monkeypatch):
    w = tmp_path / "w"
    _workspace(w)
    before = _snapshot(w)
    full_disk_from(monkeypatch, nth)
    code = main(argv.format(w=w).split())
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"ttt: error: {flag.format(w=w)}: No space left on device"
    ), err
    assert "nothing was written" in lines[0]
    after = _snapshot(w)
    made = {
        p for p in after.keys() - before.keys() if after[p] == ("dir",)
    }  # the --out folder and its subfolders
    assert {p: v for p, v in after.items() if p not in made} == before


def test_full_disk_at_govreport_prepare_is_one_line(tmp_path, capsys, monkeypatch):
    """A full disk under numpy's own write of a real file (`ndarray.tofile`, which words a short write as
    "OSError: N requested and M written", no errno, and gave a traceback). `full_disk_from` wraps the file
    object, which sends numpy down its `write` path and hides this; here every file `fileio` opens for
    writing is /dev/full instead, a real file whose every write the kernel fails with ENOSPC (a tmpfs of a few
    kB would need mount and root)."""
    from timetotrain import fileio

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    gov = require_file(shared_data_dir() / "govreport" / "gov_report.validation.scrolls_format.jsonl")
    spm = require_file(shared_data_dir() / "tokenizers" / "llama2" / "tokenizer.model")

    def opener(file, mode="r", *args, **kwargs):
        return open("/dev/full" if "w" in mode else file, mode, *args, **kwargs)

    monkeypatch.setattr(fileio, "open", opener, raising=False)  # the name `fileio` resolves `open` by
    out = tmp_path / "out"
    argv = [
        "data",
        "prepare",
        "govreport",
        "--src",
        str(gov),
        "--split",
        "train",
        "--tokenizer-model",
        str(spm),
    ]
    code = main([*argv, "--out", str(out)])
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("govreport train:")]
    assert code == 2 and len(err) == 1, err
    assert (
        err[0].startswith(f"ttt: error: --out {out}: No space left on device")
        and "nothing was written" in err[0]
    )
    assert list(out.iterdir()) == []  # no array, manifest or temporary


@pytest.mark.slow
def test_full_disk_under_any_other_writer_is_one_line(tmp_path, capsys, monkeypatch):
    """`ttt synth`'s summary is written after its log: a full disk there is the CLI's one line, not a traceback
    (the finished log stays: it is a whole synth log)."""
    full_disk_from(monkeypatch, 1)
    code = main(["synth", "llama31_8b", "--tier", "tiny", "--steps", "2", "--warmup-steps", "0", "--logdir",
                 str(tmp_path / "syn")])  # fmt: skip
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and lines[-1].startswith("ttt: error: ") and "No space left on device" in lines[-1]
    assert "Traceback" not in "\n".join(lines)
    assert not [p for p in (tmp_path / "syn").rglob("*") if p.name.startswith(".")]  # no temporaries


@pytest.mark.parametrize("how", ["from-another-prepare", "counts-too-few-ids"])
def test_a_token_count_file_no_manifest_vouches_for_is_not_trusted(how, c4_prepared, tmp_path, capsys):
    """Without the manifests, a leftover `*_token_counts.npy` neither narrows the vocabulary nor stands in for
    the tokens in the id check: one that does not count this split's tokens is refused; one that does (but
    counts too few ids) no longer hides the ids the tokens really hold. The missing manifests warn."""
    data = tmp_path / "c4"
    shutil.copytree(c4_prepared, data)
    for m in data.glob("*.manifest.json"):
        m.unlink()
    counts = data / "c4-train_token_counts.npy"
    n_tokens = int(np.load(counts).sum())
    stale = np.zeros(1000, np.int64)  # a vocabulary far smaller than the one the tokens come from
    stale[0] = n_tokens if how == "counts-too-few-ids" else 7
    np.save(counts, stale)
    before = _snapshot(data)
    argv = ["run", "llama31_8b", "--tier", "tiny", "--data", str(data), "--logdir", str(tmp_path / "logs")]
    with pytest.warns(UserWarning, match="manifest.json not found") as warned:
        code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    line = err[0]
    # (in a terminal: two `ttt: warning:` lines first)
    assert len([w for w in warned if "manifest.json not found" in str(w.message)]) == 2
    assert line.startswith(f"ttt: error: {data}/c4-train_text_document.bin" if how != "from-another-prepare"
                           else f"ttt: error: {counts}")  # fmt: skip
    assert ("outside the 1,000 ids" in line) if how == "counts-too-few-ids" else ("another prepare" in line)
    assert not list((tmp_path / "logs").rglob("result_*")) and _snapshot(data) == before


def test_a_nan_past_the_bounded_scan_is_refused_at_load(hf_tiny, tmp_path):
    """The preflight scan reads the first values of each tensor; the load checks every value it copies."""
    from timetotrain.errors import UserError
    from timetotrain.spec.registry import get
    from timetotrain.train.checkpoint import check_init_source, init_from

    bench = get("llama31_8b")
    cfg = bench.tier("tiny").model
    embed = "model.embed_tokens.weight"  # more values than the bounded scan reads: its last one is past it
    _hf_variant(hf_tiny, tmp_path / "hf", tensor=lambda t: _nan_at(t, -1), name=embed)
    assert check_init_source(tmp_path / "hf", bench.family, cfg) == "hf"  # the bounded scan misses it
    with pytest.raises(
        UserError, match=r"model\.embed_tokens\.weight \(for embed\.weight\) holds NaN or inf"
    ):
        init_from(tmp_path / "hf", bench.family.build(cfg), bench.family, cfg)


def test_set_global_batch_size_at_405b_tiny_keeps_the_tiers_own_schedule():
    """llama31_405b's rule (LR and schedule as functions of the GBS) describes its reference tier only: at
    tiny it gave an LR 1,800 times smaller and a 288,000-step warmup. The tiny tier keeps its own values,
    which its rule file accepts; the reference still takes the rule's."""
    from timetotrain.mlperf.keys import check_rules
    from timetotrain.spec.benchmark import apply_overrides
    from timetotrain.spec.registry import get

    bench = get("llama31_405b")
    tiny = bench.tier("tiny")
    t = apply_overrides(bench, tiny, ["global_batch_size=32"])
    assert t.global_batch_size == 32
    assert (t.lr, t.end_lr, t.warmup_steps, t.max_steps) == (
        tiny.lr,
        tiny.end_lr,
        tiny.warmup_steps,
        tiny.max_steps,
    )
    check_rules(bench, t)
    ref = bench.tier("reference")
    r = apply_overrides(bench, ref, [f"global_batch_size={2 * ref.global_batch_size}"])
    assert r.lr == 2 * ref.lr and r.warmup_steps == ref.warmup_steps // 2


@pytest.mark.parametrize(("name", "gbs"), [("llama31_8b", 32), ("gpt_oss_20b", 64), ("llama2_70b_lora", 32)])
def test_set_global_batch_size_at_a_tiny_tier_keeps_its_lr_and_warmup(name, gbs):
    """The RCP table (LR and warmup per GBS) is the reference's: at llama31_8b tiny, `--set
    global_batch_size=32` (docs/getting-started.md's run config) gave the 8B model's LR 8e-4 and 128 warmup
    steps in place of the tier's 3e-3 and 20. A tiny tier keeps its own; the reference still takes the RCP's."""
    from timetotrain.spec.benchmark import apply_overrides
    from timetotrain.spec.registry import get

    bench = get(name)
    tiny = bench.tier("tiny")
    t = apply_overrides(bench, tiny, [f"global_batch_size={gbs}"])
    assert (t.global_batch_size, t.lr, t.end_lr, t.warmup_steps) == (
        gbs,
        tiny.lr,
        tiny.end_lr,
        tiny.warmup_steps,
    )
    rcp = bench.rcp_hparams[gbs]
    assert (rcp.lr, rcp.warmup_steps) != (tiny.lr, tiny.warmup_steps)  # so the check above can fail
    r = apply_overrides(bench, bench.tier("reference"), [f"global_batch_size={gbs}"])
    assert (r.lr, r.warmup_steps) == (rcp.lr, rcp.warmup_steps)
