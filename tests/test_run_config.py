"""`ttt run --config FILE` (a TOML file of the command's long options) and `ttt run --dry-run`.

The file's values are the defaults the command line overrides; a bad file is one line naming it and the key;
the resolved config goes into the log (`ttt_config`); the dry run says every setting's source, the rule
check's verdict and the plan, and writes nothing.
"""

import json

import pytest
from conftest import mllog, strict_loads

from timetotrain.cli import main


def _toml(tmp_path, text: str):
    p = tmp_path / "run.toml"
    p.write_text(text)
    return p


def _dry(capsys, *argv):
    capsys.readouterr()
    code = main(["run", *argv, "--dry-run", "--json"])
    return code, strict_loads(capsys.readouterr().out)


def test_file_values_are_defaults_the_command_line_overrides(tmp_path, capsys):
    f = _toml(
        tmp_path,
        'tier = "tiny"\ndata = "data/c4"\nlogdir = "logs"\nmax-steps = 50\nparallel = "dp=1"\n'
        "[set]\nglobal_batch_size = 32\nlr = 0.004\n",
    )
    code, doc = _dry(capsys, "llama31_8b", "--config", str(f), "--max-steps", "7", "--set", "lr=1e-3")
    assert code == 0
    opts, settings = doc["options"], doc["settings"]
    assert opts["data"] == {"value": "data/c4", "source": "--config"}
    assert opts["max-steps"] == {"value": 7, "source": "command line"}
    assert opts["seed"] == {"value": None, "source": "default"}
    assert settings["global_batch_size"] == {"value": 32, "source": "--config [set]"}
    assert settings["lr"] == {"value": 1e-3, "source": "--set"}  # the command line's --set comes last
    assert settings["end_lr"]["source"].startswith("derived")  # follows the new base LR
    assert settings["target"] == {"value": 4.8, "source": "tier"}
    assert doc["config"]["file"] == str(f.resolve()) and doc["config"]["values"]["max_steps"] == 50
    assert doc["rules"]["verdict"] == "pass"
    assert doc["plan"]["per_rank_batch"] == 32 and doc["plan"]["accumulation_steps"] == 2
    assert not (tmp_path / "logs").exists()


def test_dry_run_text_and_the_closed_rule_verdict(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["run", "llama31_8b", "--tier", "reference", "--dry-run"]  # no --data, --logdir: none are read
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "  data                -               default" in out
    assert "rules: pass (official closed rules)" in out and "plan: single process" in out
    assert "  global_batch_size   16              tier" in out
    # A closed run with another eval cadence is refused by `ttt run`; the dry run says so and exits 1.
    assert main([*argv, "--set", "eval_every_samples=100"]) == 1
    assert "rules: refused" in capsys.readouterr().out
    assert main([*argv, "--set", "eval_every_samples=100", "--set", "division=open"]) == 0
    assert "rules: not checked" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.bad_input
@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('tier = "tiny"\nbatch = 3\n', "unknown key 'batch'"),
        ('tier = "tiny"\ndata = \n', "not valid TOML"),
        ('tier = "tiny"\nmax-steps = "ten"\n', "max-steps = 'ten': expected an integer"),
        ('tier = "tiny"\nprecision = "fp4"\n', "precision = 'fp4': choose one of"),
        ('tier = "tiny"\nac = "yes"\n', "ac = 'yes': expected true or false"),
        ('tier = "tiny"\ndata = 4\n', "expected a string"),
        ('tier = "tiny"\nset = 3\n', "set must be a table"),
        ('benchmark = "gpt_oss_20b"\ntier = "tiny"\n', "the command line names another"),
        ('tier = "tiny"\ndry-run = true\n', "unknown key 'dry-run'"),
    ],
)
def test_bad_config_is_one_line_naming_the_file(tmp_path, capsys, text, said):
    f = _toml(tmp_path, text)
    code = main(["run", "llama31_8b", "--config", str(f), "--data", "d", "--logdir", str(tmp_path / "l")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"ttt: error: --config {f}: ") and said in err
    assert not (tmp_path / "l").exists()


@pytest.mark.bad_input
def test_missing_config_file(tmp_path, capsys):
    code = main(["run", "llama31_8b", "--config", str(tmp_path / "no.toml")])
    err = capsys.readouterr().err
    assert code == 2 and err == f"ttt: error: --config {tmp_path / 'no.toml'}: no such file\n"


@pytest.mark.e2e
def test_the_run_logs_its_config(tmp_path, capsys, monkeypatch):
    """The toy benchmark in-process, every required flag from the file: the log carries ttt_config (file,
    sha256, values) beside the resolved ttt_data and ttt_set a package's script repeats the run from."""
    from toy_benchmark import make_data

    monkeypatch.setenv("TTT_EXTRA_BENCHMARKS", "toy_benchmark")
    make_data(tmp_path / "data")
    f = _toml(
        tmp_path,
        f'tier = "tiny"\ndata = "{tmp_path / "data"}"\nlogdir = "{tmp_path / "logs"}"\nseed = 1\nquiet = true\n',
    )
    assert main(["run", "toy_classify", "--config", str(f)]) == 0
    log = tmp_path / "logs" / "toy_classify" / "tiny" / "result_0.txt"
    events = {e["key"]: e["value"] for e in mllog(log)}
    conf = events["ttt_config"]
    assert conf["file"] == str(f.resolve()) and conf["values"]["seed"] == 1 and len(conf["sha256"]) == 64
    assert events["ttt_data"] == str((tmp_path / "data").resolve()) and events["seed"] == 1
    json.dumps(conf)
    assert main(["check", str(log)]) == 0  # the rule file takes the extra key


def test_synth_dry_run_says_steps_layers_and_builds_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["synth", "flux1", "--layers", "3", "--steps", "4", "--dry-run", "--json"]) == 0
    doc = strict_loads(capsys.readouterr().out)
    assert doc["command"] == "synth" and doc["rules"]["verdict"] == "not checked"
    assert doc["synth"] == {"steps": 4, "warmup_steps": 5, "layers": 3, "layers_source": "--layers"}
    assert (doc["model"]["n_double"], doc["model"]["n_single"]) == (1, 2)  # the reduced model, 19:38
    assert doc["options"]["precision"]["source"] == "default" and doc["plan"]["parallel"].endswith("fp32")
    assert main(["synth", "llama31_405b", "--tier", "reference", "--dry-run"]) == 0
    assert "1 layer(s) (the tier's synth default)" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_dry_run_estimates_embedding_tables_as_ttt_plan_does(capsys):
    """dlrm_dcnv2's memory is its tables' (train/embedding_memory.py), not the block formula's: the dry run
    gives ttt plan's figure for the most loaded rank instead of an internal error's name."""
    code, doc = _dry(capsys, "dlrm_dcnv2", "--tier", "reference")
    plan = doc["plan"]
    assert code == 0 and plan["memory_per_rank_gib"] > 100  # 26 B fp32 rows + Adagrad state on one process
    assert "tables" in plan["memory_per_rank_gib_reason"]
