"""The real Llama 3 tokenizer: the tiktoken BPE file shipped in the PyPI package `llama-models==0.3.0`.

We load the file ourselves (rather than importing llama_models' Tokenizer) so only `tiktoken` is needed at
run time; the split pattern and the 256 special tokens follow the Llama 3 definition: 128,000 BPE ranks,
then `<|begin_of_text|>`=128000, `<|end_of_text|>`=128001, ..., 128,256 ids in all.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from timetotrain.errors import UserError

LLAMA3_SHA256 = "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_NAMED_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
]
N_SPECIAL = 256
# End-of-text ids, known without loading the BPE file (a run needs the id, not the tokenizer).
EOS_IDS = {"llama3": 128001}
# tiktoken's Rust core panics on very long runs without a split point; C4 has a few such documents.
_MAX_RUN = 25_000
_MAX_CHUNK = 400_000


@dataclass(frozen=True)
class TokenizerFile:
    """What every tokenizer we load records about itself, for manifests: the file and its special ids."""

    name: str
    path: str
    sha256: str
    vocab_size: int
    bos_id: int
    eos_id: int

    def identity(self) -> dict:
        return {
            "name": self.name,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
        }


@dataclass(frozen=True)
class Tokenizer(TokenizerFile):
    encoding: object  # tiktoken.Encoding

    def encode(self, text: str) -> list[int]:
        """Ordinary text to ids; special-token strings in the text are encoded as plain text."""
        out: list[int] = []
        enc = self.encoding.encode_ordinary
        for piece in _safe_pieces(text):
            out.extend(enc(piece))
        return out

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]


def _safe_pieces(text: str):
    if len(text) <= _MAX_RUN:
        yield text
        return
    for start in range(0, len(text), _MAX_CHUNK):
        chunk = text[start : start + _MAX_CHUNK]
        yield from _split_long_runs(chunk)


def _split_long_runs(s: str):
    """Cut a string so no piece holds more than _MAX_RUN consecutive (non-)whitespace characters."""
    begin = 0
    run_start = 0
    in_space = s[0].isspace() if s else False
    for i, ch in enumerate(s):
        sp = ch.isspace()
        if sp != in_space:
            in_space = sp
            run_start = i
        elif i - run_start >= _MAX_RUN:
            yield s[begin:i]
            begin = run_start = i
    yield s[begin:]


def llama3_path() -> Path:
    try:
        import llama_models  # optional: only --tokenizer llama3; missing, one UserError line
    except ImportError as e:
        raise UserError(
            "Llama 3 tokenizer not installed: run `pip install llama-models==0.3.0` (it ships tokenizer.model)"
        ) from e
    path = Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"
    if not path.is_file():
        raise UserError(
            f"{path} is missing: reinstall with `pip install --force-reinstall llama-models==0.3.0`"
        )
    return path


@cache
def load(name: str) -> Tokenizer:
    if name != "llama3":
        raise UserError(f"unknown tokenizer {name!r}: this version supports --tokenizer llama3")
    try:
        import tiktoken  # optional: only --tokenizer llama3; missing, one UserError line
        from tiktoken.load import load_tiktoken_bpe
    except ImportError as e:
        raise UserError("tiktoken is not installed: run `pip install tiktoken`") from e
    path = llama3_path()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != LLAMA3_SHA256:
        raise UserError(
            f"{path} has sha256 {digest[:12]}…, expected {LLAMA3_SHA256[:12]}…: "
            "reinstall with `pip install --force-reinstall llama-models==0.3.0`"
        )
    ranks = load_tiktoken_bpe(str(path))
    names = _NAMED_SPECIALS + [f"<|reserved_special_token_{i}|>" for i in range(2, N_SPECIAL - 10)]
    specials = {tok: len(ranks) + i for i, tok in enumerate(names)}
    enc = tiktoken.Encoding(
        name="llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials
    )
    return Tokenizer(
        name="llama3",
        path=str(path),
        sha256=digest,
        vocab_size=len(ranks) + len(names),
        bos_id=specials["<|begin_of_text|>"],
        eos_id=specials["<|end_of_text|>"],
        encoding=enc,
    )
