"""A SentencePiece tokenizer loaded from a `tokenizer.model` file the user names (`--tokenizer-model FILE`).

llama2_70b_lora uses Meta's Llama 2 tokenizer (32,000 pieces, `<unk>`=0, `<s>`=1, `</s>`=2), and llama31_405b's
C4 the Mixtral 8x22B one (32,768 pieces, same special ids). Unlike the Llama 3 file, neither is shipped by a
pip package we depend on, so the user points at a copy (Hugging Face
`meta-llama/Llama-2-70b-hf/tokenizer.model`, or the one in the MLCommons model folder). We read BOS/EOS ids from
the file rather than hard-coding them, record the file's sha256 in every manifest, and name it `llama2` when
the sha256 is a known file (`llama2`, `mixtral`) so a prepared dataset says which tokenizer made it.

`encode` returns plain ids with neither BOS nor EOS: SentencePiece's own dummy-prefix rule (a leading `▁`) is
what the Hugging Face Llama tokenizer applies too, and callers add BOS/EOS themselves where the recipe says.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from timetotrain import fileio
from timetotrain.data.tokenizer import TokenizerFile
from timetotrain.errors import UserError

# Meta's Llama 2 tokenizer.model (identical in the HF meta-llama/Llama-2-* repos).
LLAMA2_SHA256 = "9e556afd44213b6bd1be2b850ebbbd98f5481437a8021afaf58ee7fb1818d347"
# Mistral's "v3" tokenizer.model, 32,768 pieces: the Mixtral 8x22B tokenizer that llama31_405b's C4 is
# tokenized with (mistralai/Mistral-7B-Instruct-v0.3 `tokenizer.model.v3`, the same 587,404 bytes).
MIXTRAL_SHA256 = "37f00374dea48658ee8f5d0f21895b9bc55cb0103939607c8185bfd1c6ca1f89"
# The files we know by content, so a manifest names the tokenizer rather than "some SentencePiece file".
KNOWN = {LLAMA2_SHA256: "llama2", MIXTRAL_SHA256: "mixtral"}


@dataclass(frozen=True)
class SentencePieceTokenizer(TokenizerFile):
    processor: object  # sentencepiece.SentencePieceProcessor

    def identity(self) -> dict:
        # The user names the file, so the manifest records which one it was.
        return {**super().identity(), "file": Path(self.path).name}

    def encode(self, text: str) -> list[int]:
        """Text to ids, no BOS/EOS. Special-token strings in the text (`</s>`) stay plain text."""
        return self.processor.encode(text)

    def encode_batch(self, texts: list[str], threads: int = 1) -> list[list[int]]:
        # SentencePiece threads in C++, so a batch uses several cores without a process pool.
        return self.processor.encode(texts, num_threads=max(1, threads))

    def decode(self, ids: list[int]) -> str:
        return self.processor.decode(ids)


def load(path: Path | str) -> SentencePieceTokenizer:
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"--tokenizer-model {path} does not exist: point it at the Llama 2 tokenizer.model "
            "(e.g. meta-llama/Llama-2-70b-hf/tokenizer.model)"
        )
    try:
        import sentencepiece as spm  # optional: only --tokenizer-model; missing, one UserError line
    except ImportError as e:
        raise UserError("sentencepiece is not installed: run `pip install sentencepiece`") from e
    data = fileio.read_bounded(path, fileio.SMALL_FILE, "--tokenizer-model")
    digest = hashlib.sha256(data).hexdigest()
    proc = spm.SentencePieceProcessor()
    try:
        # From bytes, so the digest we record is of exactly what was loaded.
        proc.LoadFromSerializedProto(data)
    except (RuntimeError, OSError, TypeError) as e:
        raise UserError(
            f"--tokenizer-model {path} cannot be parsed as a SentencePiece model: "
            "pass the Llama 2 tokenizer.model, not tokenizer.json or a tiktoken file"
        ) from e
    bos, eos = proc.bos_id(), proc.eos_id()
    if bos < 0 or eos < 0:
        raise UserError(
            f"--tokenizer-model {path} defines no BOS/EOS pieces (bos {bos}, eos {eos}): "
            "the GovReport recipe needs both; pass the Llama 2 tokenizer.model"
        )
    return SentencePieceTokenizer(
        name=KNOWN.get(digest, "sentencepiece"),
        path=str(path),
        sha256=digest,
        vocab_size=proc.vocab_size(),
        bos_id=bos,
        eos_id=eos,
        processor=proc,
    )
