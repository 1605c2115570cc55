"""Verifiable arithmetic problems: the tiny tier's stand-in for the reference's SWE tasks.

Each problem is a prompt "a+b=" with both operands zero-padded to `digits` digits, so that every prompt of a set
has the same length (rectangular batches, no padding inside a prompt), and the answer is the digits of a + b
least significant first ("37+48=" -> "58"): each digit then depends only on the operands and the carry
already written, which a model this small learns in minutes, where most-significant-first needs the carry
before the digits that make it. Tokens
are characters: the ten digits, '+' and '=', then EOS, BOS and PAD; a model's completion is its digits up to
EOS. The sets are files written once (`write_problems`, the tier's data recipe) and checksummed in a
manifest, so a run reads a fixed, verifiable train order and validation set, as the reference reads its
curriculum JSONL (no shuffling at run time) and its held-out tasks.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from timetotrain import fileio
from timetotrain.data.manifest import sha256_file
from timetotrain.errors import UserError

CHARS = "0123456789+="
EOS, BOS, PAD = len(CHARS), len(CHARS) + 1, len(CHARS) + 2
VOCAB_SIZE = 16  # the 15 ids above, rounded up
TRAIN, VALIDATION = "arithmetic_train.jsonl", "arithmetic_validation.jsonl"
MANIFEST = "arithmetic_manifest.json"
KINDS = ("add", "reverse")


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def encode(text: str) -> list[int]:
    return [CHARS.index(c) for c in text]


def decode(ids: list[int]) -> str:
    """The text of a completion up to its EOS (ids outside the characters end it too)."""
    out = []
    for i in ids:
        if i >= len(CHARS):
            break
        out.append(CHARS[i])
    return "".join(out)


def prompt_ids(p: Problem) -> list[int]:
    return [BOS, *encode(p.prompt)]


def answer_ids(p: Problem) -> list[int]:
    return [*encode(p.answer), EOS]


def draw(
    n: int, digits: int, rng: random.Random, exclude: set[str] = frozenset(), kind: str = "add"
) -> list[Problem]:
    """`kind` "add": "a+b=" -> the sum's digits reversed; "reverse": "d1..dk+e1..ek=" -> all 2k digits in
    reverse order (a routing task with no carries: the easiest verifiable task of the same prompt shape)."""
    hi = 10**digits
    out, seen = [], set(exclude)
    while len(out) < n:
        a, b = rng.randrange(hi), rng.randrange(hi)
        prompt = f"{a:0{digits}d}+{b:0{digits}d}="
        if prompt in seen:
            continue
        seen.add(prompt)
        answer = str(a + b)[::-1] if kind == "add" else prompt[:-1].replace("+", "")[::-1]
        out.append(Problem(prompt, answer))
    return out


def answer_digits(digits: int, kind: str) -> int:
    """The longest answer of a kind (without EOS)."""
    return digits + 1 if kind == "add" else 2 * digits


def write_problems(
    out: Path, digits: int, n_train: int, n_val: int, seed: int = 0, kind: str = "add"
) -> None:
    """Disjoint train and validation sets and their manifest (sha256 of each file)."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: one of {KINDS}")
    rng = random.Random(seed)
    val = draw(n_val, digits, rng, kind=kind)
    train = draw(n_train, digits, rng, exclude={p.prompt for p in val}, kind=kind)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, probs in ((TRAIN, train), (VALIDATION, val)):
        fileio.write_text(out / name, "".join(json.dumps(p.__dict__) + "\n" for p in probs))
    doc = {
        "digits": digits,
        "kind": kind,
        "seed": seed,
        "files": {
            n: {"sha256": sha256_file(out / n), "problems": k}
            for n, k in ((TRAIN, n_train), (VALIDATION, n_val))
        },
    }
    fileio.write_text(out / MANIFEST, json.dumps(doc, indent=2, sort_keys=True) + "\n")


def check(folder: Path, digits: int, kind: str, verify: bool = True) -> list[Path]:
    """Preflight: the manifest and both files present, of `digits` and `kind`, unchanged. One UserError line
    if not."""
    folder = Path(folder)
    man = folder / MANIFEST
    hint = "make it with `ttt data prepare --for qwen35_397b_grpo --tier tiny --src sources --out DIR`"
    if not man.is_file():
        raise UserError(f"--data {folder} has no {MANIFEST}: {hint}")
    try:
        doc = json.loads(fileio.read_bounded(man, fileio.SMALL_FILE, "manifest").decode())
        files = doc["files"]
        if (doc["digits"], doc["kind"]) != (digits, kind):
            raise UserError(
                f"{man}: {doc['kind']} problems of {doc['digits']} digits, the tier needs {kind} of {digits}: {hint}"
            )
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{man} is not a valid manifest ({e}): {hint}") from None
    paths = []
    for name in (TRAIN, VALIDATION):
        path = folder / name
        if name not in files or not path.is_file():
            raise UserError(f"--data {folder} has no {name}: {hint}")
        if verify and sha256_file(path) != files[name].get("sha256"):
            raise UserError(f"{path} does not match {MANIFEST} (sha256): it changed; {hint}")
        paths.append(path)
    return paths


def read(path: Path, digits: int) -> list[Problem]:
    """The problems of a file `check` passed; a malformed line is one UserError naming file and line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for k, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
                p = Problem(str(rec["prompt"]), str(rec["answer"]))
                encode(p.prompt), encode(p.answer)
                if len(p.prompt) != 2 * digits + 2:
                    raise ValueError(f"prompt {p.prompt!r} is not two {digits}-digit operands")
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise UserError(f"{path} line {k}: not a problem ({e})") from None
            out.append(p)
    if not out:
        raise UserError(f"{path} holds no problem")
    return out
