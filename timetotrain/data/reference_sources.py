"""Where each benchmark's reference-tier data comes from, as the MLCommons references name it: the table
`ttt data download --for BENCH --tier reference` reads, so no user has to find the storage metadata URLs in
the references' READMEs.

Every source is cited as `file:line` of mlcommons/training (commit aa344c7f, "LLM post training RCP logs and
finalized description (#895)"). A `Fetch` is a dataset of MLCommons' storage bucket: the `.uri` metadata URL
the reference passes to the MLCommons R2 downloader (its `-d` folder, or ours where the README leaves it to
the user), downloaded by `download.download_mlcommons` (the `.md5` beside the `.uri`, every file md5-checked).
A `Manual` is what no URL fetches: a licence click, a gated Hugging Face repository, a members-only bucket.
A required one (the run's data) makes the command one line and an exit before anything is written; one that
is not (the starting checkpoint, given to `ttt run --init-checkpoint`) is a note after the download.

Sizes are the READMEs' own figures (the bucket publishes none before the download); None where none is given.
"""

from __future__ import annotations

from dataclasses import dataclass

STORAGE = "https://training.mlcommons-storage.org"  # every .uri below lies under STORAGE/metadata/
R2_DOWNLOADER = (
    "https://raw.githubusercontent.com/mlcommons/r2-downloader/refs/heads/main/mlc-r2-downloader.sh"
)


@dataclass(frozen=True)
class Fetch:
    name: str  # the dataset's name in the bucket: its metadata file is STORAGE/metadata/<name>.uri
    folder: str  # where it lands under --out (the reference's `-d`)
    what: str
    size: str | None
    source: str  # file:line in mlcommons/training

    @property
    def metadata(self) -> str:
        return f"{STORAGE}/metadata/{self.name}.uri"


@dataclass(frozen=True)
class Manual:
    what: str
    do: str  # what the user must do, and where
    source: str
    required: bool = True  # False: the init checkpoint, which a run may go without (random weights)


@dataclass(frozen=True)
class ReferenceData:
    fetch: tuple[Fetch, ...] = ()
    manual: tuple[Manual, ...] = ()
    # The steps after the download, "{out}" for --out; the last is the run.
    then: tuple[str, ...] = ()


_C4_8B = "llama-3-1-8b-preprocessed-c4-dataset"  # Llama 3.1 8B tokenizer, .bin/.idx as ttt reads them
_C4_8B_WHAT = "C4 en_6 + 91,205 validation documents, Llama 3.1 tokens"


def _one(fetch: Fetch, run: str, *manual: Manual) -> ReferenceData:
    """A benchmark of one dataset, read as it is: the run line follows the download."""
    return ReferenceData(fetch=(fetch,), manual=manual, then=(run,))


# One row a source; the rows are kept on one line each (`fmt: off`) so the table reads as a table.
# fmt: off
REFERENCE: dict[str, ReferenceData] = {
    # small_llm_pretraining/nemo/README.md:31 (data; the tokenizer at :37 is not needed: ttt's Llama 3
    # tokenizer ships with llama-models). The files are c4-train.en_6_text_document and
    # c4-validation-91205-samples.en_text_document (.bin/.idx), the names the loader takes as they are
    # (suite/c4_llm.py), so no prepare step follows. Size: small_llm_moe_pretraining/primus/README.md:40.
    "llama31_8b": _one(
        Fetch(_C4_8B, "llama3_1_8b_preprocessed_c4_dataset", _C4_8B_WHAT, "~80 GB", "small_llm_pretraining/nemo/README.md:31"),
        "ttt run llama31_8b --tier reference --logdir LOGS --data {out}/llama3_1_8b_preprocessed_c4_dataset",
    ),
    # small_llm_moe_pretraining/primus/README.md:32-33 (`-d data`), size :40.
    "gpt_oss_20b": _one(
        Fetch(_C4_8B, "data", _C4_8B_WHAT, "~80 GB", "small_llm_moe_pretraining/primus/README.md:32"),
        "ttt run gpt_oss_20b --tier reference --logdir LOGS --data {out}/data",
    ),
    # llm_moe_pretraining/nemo/README.md:72 (data); the checkpoint (:127-133) is members-only.
    "deepseekv3_671b": _one(
        Fetch(_C4_8B, "llama3_1_8b_preprocessed_c4_dataset", _C4_8B_WHAT, "~80 GB", "llm_moe_pretraining/nemo/README.md:72"),
        "ttt run deepseekv3_671b --tier reference --logdir LOGS --data {out}/llama3_1_8b_preprocessed_c4_dataset --init-checkpoint CKPT",
        Manual(
            "MLCommons' BF16 DeepSeek-V3 checkpoint (~1.4 TB)",
            "MLCommons Members only (https://training.mlcommons-storage.org/index.html#deepseekv3-benchmark): "
            f"run `bash <(curl -s {R2_DOWNLOADER}) -d CKPT {STORAGE}/metadata/deepseekv3_checkpoint_bf16.uri` "
            "and pass --init-checkpoint CKPT",
            "llm_moe_pretraining/nemo/README.md:127-133",
            required=False,
        ),
    ),
    # large_language_model_pretraining/nemo/README.md:67 (data, `-d $PREPROCESSED_PATH`), :79 (tokenizer:
    # the Mixtral SentencePiece files; the folder names are ours, the README leaves them to the user).
    "llama31_405b": ReferenceData(
        fetch=(
            Fetch("mixtral-8x22b-preprocessed-c4-dataset", "mixtral_8x22b_preprocessed_c4", "C4 en_6, en_7 + 91,205 validation documents, Mixtral tokens", None, "large_language_model_pretraining/nemo/README.md:67"),
            Fetch("mixtral-8x22b-tokenizer", "mixtral_8x22b_tokenizer", "the Mixtral 8x22B tokenizer (5 files)", None, "large_language_model_pretraining/nemo/README.md:79"),
        ),
        manual=(
            Manual(
                "Meta's Llama 3.1 405B checkpoint (BF16)",
                "accept Meta's licence at https://huggingface.co/meta-llama/Llama-3.1-405B, then `hf download "
                "meta-llama/Llama-3.1-405B --local-dir CKPT` (the BF16 repository, not -FP8) and pass "
                "--init-checkpoint CKPT (MLCommons' converted NeMo copy is for members: https://llama3-1.mlcommons.org, "
                "a layout ttt does not read)",
                "large_language_model_pretraining/nemo/README.md:129,234",
                required=False,
            ),
        ),
        then=("ttt run llama31_405b --tier reference --logdir LOGS --data {out}/mixtral_8x22b_preprocessed_c4 --init-checkpoint CKPT",),
    ),
    # llama2_70b_lora/README.md:44-46: model and preprocessed GovReport both members-only.
    "llama2_70b_lora": ReferenceData(
        manual=(
            Manual(
                "the Llama 2 70B model and MLCommons' scrolls_gov_report_8k",
                "both are for MLCommons Members only: agree to the confidentiality notice at "
                "https://llama2.mlcommons.org with your organisation's email, run the R2 downloader commands "
                "its instructions page gives, then `ttt data prepare govreport --src <scrolls_gov_report_8k> "
                "--split train|validation --tokenizer-model <llama2 tokenizer.model> --out DATA` and `ttt run "
                "llama2_70b_lora --tier reference --logdir LOGS --data DATA --init-checkpoint <the model>` "
                "(docs/benchmarks/llama2_70b_lora.md)",
                "llama2_70b_lora/README.md:44",
            ),
        ),
    ),
    # text_to_image/README.md:117-119 (the preprocessed encodings the reference recommends, :55), size :122;
    # folder names as the README's paths (/dataset/cc12m_preprocessed, :132) and what the importer finds
    # beside --src (empty_encodings/, data/flux_mlcommons.py).
    "flux1": ReferenceData(
        fetch=(
            Fetch("flux-1-cc12m-preprocessed", "cc12m_preprocessed", "CC12M T5/CLIP/VAE encodings (train)", "~2.5 TB with COCO", "text_to_image/README.md:117"),
            Fetch("flux-1-coco-preprocessed", "coco_preprocessed", "COCO-2014 encodings (validation)", None, "text_to_image/README.md:118"),
            Fetch("flux-1-empty-encodings", "empty_encodings", "the empty-caption T5/CLIP encodings", None, "text_to_image/README.md:119"),
        ),
        then=(
            "ttt data prepare flux --src {out}/cc12m_preprocessed --split train --out DATA",
            "ttt data prepare flux --src {out}/coco_preprocessed --split validation --out DATA",
            "ttt run flux1 --tier reference --logdir LOGS --data DATA",
        ),
    ),
    # recommendation_v2/torchrec_dlrm/README.MD:146 (the materialized multi-hot days, 3.8 TB: :177). The raw
    # Criteo 1TB click logs behind it need Criteo's terms; this download does not.
    "dlrm_dcnv2": _one(
        Fetch("dlrmv2-preprocessed-criteo-click-logs", "criteo_multihot", "the 24 days of multi-hot Criteo (day_<d>_dense.npy, _labels.npy, _sparse_multi_hot.npz)", "~3.8 TB", "recommendation_v2/torchrec_dlrm/README.MD:146"),
        "ttt run dlrm_dcnv2 --tier reference --logdir LOGS --data {out}/criteo_multihot",
    ),
    # retired_benchmarks/rgat/README.md:67, size :75. Its layout under the folder is the bucket's (IGBH
    # `full/processed/`); --data takes the folder holding paper/ or full/processed/ (data/igbh.py).
    "rgat": _one(
        Fetch("gnn-igbh-dataset-full", "igbh", "IGBH-full (features, labels, edges)", "~2.2 TB", "retired_benchmarks/rgat/README.md:67"),
        "ttt run rgat --tier reference --logdir LOGS --data {out}/igbh",
    ),
    # llm_post_training/README.md:153-236, download_dataset.sh:21-24, download_checkpoint.sh:19-20.
    "qwen35_397b_grpo": ReferenceData(
        manual=(
            Manual(
                "R2E-Gym tasks and the Qwen3.5-397B-A17B checkpoint",
                "the reference tier does not run in timetotrain (its rollouts are the reference's R2E-Gym SWE "
                "agent), so nothing is downloaded; for the reference itself run llm_post_training/"
                "download_dataset.sh (Hugging Face R2E-Gym/R2E-Gym-Subset@e8b9fcbc, converted, checked by "
                "verify_dataset.sh) and download_checkpoint.sh (Qwen/Qwen3.5-397B-A17B@84726181) in "
                "mlcommons/training",
                "llm_post_training/download_dataset.sh:21",
            ),
        ),
    ),
}
# fmt: on


def reference_data(bench: str) -> ReferenceData | None:
    return REFERENCE.get(bench)
