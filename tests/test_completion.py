"""`ttt completion bash|zsh`: generated from the parser, valid shell, completing what the parser holds."""

import argparse
import shutil
import subprocess

import pytest

from timetotrain.cli import build_parser, main
from timetotrain.spec import registry

pytestmark = pytest.mark.e2e  # runs bash on the script

BASH = shutil.which("bash")


def _script(capsys, shell: str) -> str:
    capsys.readouterr()
    assert main(["completion", shell]) == 0
    return capsys.readouterr().out


def _commands(p: argparse.ArgumentParser, prefix=()) -> list[tuple[str, ...]]:
    out = []
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, child in a.choices.items():
                out += [(*prefix, name), *_commands(child, (*prefix, name))]
    return out


@pytest.mark.skipif(BASH is None, reason="no bash")
def test_bash_script_is_valid_and_holds_every_command_and_benchmark(capsys, tmp_path):
    text = _script(capsys, "bash")
    f = tmp_path / "ttt.bash"
    f.write_text(text)
    subprocess.run([BASH, "-n", str(f)], check=True)
    for cmd in _commands(build_parser()):
        assert cmd[-1] in text, cmd
    for name in registry.names():
        assert name in text


@pytest.mark.skipif(BASH is None, reason="no bash")
def test_bash_completes_commands_benchmarks_tiers_and_flags(capsys, tmp_path):
    f = tmp_path / "ttt.bash"
    f.write_text(_script(capsys, "bash"))
    cases = {
        "ttt ru": "run rules",
        "ttt run llama31_8": "llama31_8b",
        "ttt run llama31_8b --tier ''": "reference tiny",
        "ttt run llama31_8b --dry": "--dry-run",
        "ttt data prepare --for gpt": "gpt_oss_20b",
        "ttt data ''": "download prepare synth-graph synth-criteo synth-yambda",
        "ttt plan x --precision ''": "bf16 fp32 fp8",
        "ttt rcp build --ti": "--tier",
    }
    lines = [f"source {f}"]
    for words in cases:
        lines.append(
            f"COMP_WORDS=({words}); COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1)); COMPREPLY=(); _ttt_complete; "
            'echo "${COMPREPLY[*]}"'
        )
    out = subprocess.run([BASH, "-c", "\n".join(lines)], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == list(cases.values())


def test_zsh_script_loads_the_bash_tables_through_bashcompinit(capsys, tmp_path):
    text = _script(capsys, "zsh")
    assert "bashcompinit" in text and "complete -o default -F _ttt_complete ttt" in text
    zsh = shutil.which("zsh")
    if zsh is not None:
        f = tmp_path / "ttt.zsh"
        f.write_text(text)
        subprocess.run([zsh, "-n", str(f)], check=True)
        # Loaded as ~/.zshrc would: registered for ttt, and completing a tier from the same tables.
        probe = (
            f"autoload -U compinit; compinit -u; source {f}; echo ${{_comps[ttt]}}; setopt ksharrays; "
            "COMP_WORDS=(ttt run llama31_8b --tier ''); COMP_CWORD=4; _ttt_complete; echo ${COMPREPLY[*]}"
        )
        out = subprocess.run([zsh, "-fc", probe], capture_output=True, text=True, check=True).stdout
        assert out.splitlines() == ["_bash_complete -o default -F _ttt_complete", "reference tiny"]
