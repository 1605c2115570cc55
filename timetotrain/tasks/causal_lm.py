"""Causal language-model pretraining on token windows (llama31_8b, gpt_oss_20b; docs/benchmarks/).

Data: Megatron indexed files (`ttt data prepare c4`, or MLCommons' preprocessed C4), windows of
`seq_len + 1` tokens drawn as megatron-core's GPTDataset draws them (`data/gpt_dataset.py`); the eval set
is the first `eval_samples` windows of the validation file in document order (or whole global batches
of them, `LMData.eval_whole_batches`), or, for a tier whose reference draws them afresh at each evaluation,
the next windows of Megatron-Bridge's cyclic sampler (`LMData.val_draw`, `data/cyclic_sampler.py`). A tier
may narrow the vocabulary to the K most frequent training ids plus one "other" id (`LMData.vocab_keep`).

Loss: mean next-token cross-entropy, optionally ignoring the positions whose input is end-of-document
(Megatron's `eod_mask_loss`). Metric: the token-weighted mean cross-entropy over the eval windows
(log-perplexity), lower is better, eval points counted in samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from timetotrain.data import loader, sources
from timetotrain.data.cyclic_sampler import CyclicDraw, reference_val_samples
from timetotrain.data.tokenizer import EOS_IDS
from timetotrain.errors import UserError
from timetotrain.spec.task import Batch, DataRecipe, Metric, RunData, Share, Task, evaluate_ratio


@dataclass(frozen=True)
class LMData:
    """A tier's token data. Prefixes are tried in order (ours first, then MLCommons' names)."""

    seq_len: int
    train_prefixes: tuple[str, ...]
    val_prefixes: tuple[str, ...]
    tokenizer: str = "llama3"
    # Keep the K most frequent training ids and map every other id to one extra "other" id (tiny tiers):
    # the full 128k-row embedding and head would dominate a 2-core run (docs/tiers.md).
    vocab_keep: int | None = None
    # Training files blended by weight as megatron-core's BlendedDataset does (data/blend.py): each entry is
    # (names tried in order, weight). Empty: the one file of `train_prefixes`.
    train_blend: tuple[tuple[tuple[str, ...], float], ...] = ()
    # Evaluations skipped before the first one, floor(a * GBS + b) for (a, b) (llama31_405b: 0.0026, 12);
    # None: evaluate from the first eval point.
    skip_evals: tuple[float, float] | None = None
    # (a, b): no evaluation before step a + b // GBS (deepseekv3_671b: Megatron-Bridge's start_eval_at_iter,
    # 42 + 24576 // GBS); None: none.
    start_eval: tuple[int, int] | None = None
    # Whether an evaluation reads whole global batches, ceil(eval_samples / GBS) of them (llama31_405b: NeMo's
    # limit_val_batches counts global batches); eval_samples is still what the log reports.
    eval_whole_batches: bool = False
    # Which windows an evaluation reads: "first", the first eval windows of the validation file in document
    # order, the same at every evaluation; "megatron_cyclic", the next ones of Megatron-Bridge's persistent
    # cyclic sampler over the seed-shuffled validation set (data/cyclic_sampler.py; deepseekv3_671b).
    val_draw: str = "first"
    # Whether the eval interval and the eval batches are floor(samples / GBS), not rounded up (gpt_oss_20b:
    # Primus's config does the shell's integer division, `$((EVAL_SAMPLES_INTERVAL / GBS))` and
    # `$((EVAL_SAMPLES / GBS))`, so 1,008 windows at GBS 48); at least one step and one batch.
    floor_to_steps: bool = False
    # Whether the first evaluation comes where the reference's NeMo trainer first puts it (llama31_8b):
    # Lightning reads the initial `val_check_interval = ceil(eval_every / GBS) / GBS` before its callback
    # resets the cadence (`CausalLM.early_eval_step`).
    nemo_first_val_check: bool = False


def targets(tokens: torch.Tensor, eod_id: int | None) -> torch.Tensor:
    """Next-token labels; with `eod_id`, positions whose *input* is end-of-document are ignored (Megatron's
    `eod_mask_loss`: the token after an EOD starts an unrelated document and cannot be predicted)."""
    labels = tokens[:, 1:]
    if eod_id is None:
        return labels
    return labels.masked_fill(tokens[:, :-1] == eod_id, -100)


def lm_loss(model, tokens: torch.Tensor, eod_id: int | None, reduction: str = "mean") -> torch.Tensor:
    # The model applies its head and the loss together (models/common/head_loss.py): no [tokens, vocab] logits.
    return model(tokens[:, :-1], labels=targets(tokens, eod_id), reduction=reduction)


class Evaluator:
    """Mean next-token cross-entropy over the validation windows (token-weighted), each rank computing its
    share and the sums reduced across ranks. `draw(k)` gives this rank's windows of the k-th evaluation; a
    fixed set (`draw=None`) is read once and kept on the device."""

    def __init__(self, windows, table, device, micro_batch: int, world: int = 1, eod_id=None, draw=None):
        self.windows, self.table, self.draw = windows, table, draw
        self.micro_batch, self.world, self.device, self.eod_id = micro_batch, world, device, eod_id
        self.count = 0  # evaluations done
        self.tokens = self._load(range(len(windows))) if draw is None else None

    @classmethod
    def fixed(cls, windows, n: int, table, device, micro_batch: int, share: Share, eod_id=None):
        """The first `n` windows, this rank's contiguous share of them."""
        part = share.part(n)
        return cls(_Slice(windows, part.start, part.stop), table, device, micro_batch, share.world, eod_id)

    def _load(self, indices) -> torch.Tensor:
        tokens = self.windows.batch(list(indices))
        if self.table is not None:
            tokens = self.table[tokens]
        return tokens.to(self.device)

    def __call__(self, model, autocast=None) -> float:
        def sums(model, chunk):  # loss sum, token count: the token-weighted mean
            labels = targets(chunk, self.eod_id)
            return model(chunk[:, :-1], labels=labels, reduction="sum"), (labels != -100).sum()

        tokens = self.tokens if self.draw is None else self._load(self.draw(self.count))
        self.count += 1
        return evaluate_ratio(model, tokens.split(self.micro_batch), sums, self.device, self.world, autocast)


class _Slice:
    """Windows [lo, hi) of a window set, as a window set."""

    def __init__(self, windows, lo: int, hi: int):
        self.windows, self.lo, self.hi = windows, lo, hi

    def __len__(self) -> int:
        return self.hi - self.lo

    def batch(self, indices) -> torch.Tensor:
        return self.windows.batch([self.lo + i for i in indices])


class _TokenData(RunData):
    def __init__(self, source: loader.TokenSource, evaluator: Evaluator, eod_id: int | None):
        self.source, self.evaluator, self.eod_id = source, evaluator, eod_id

    def batch(self, step: int) -> Batch:
        return {"tokens": self.source.batch(step)}

    def loss(self, model, batch: Batch, reduction: str = "mean") -> torch.Tensor:
        return lm_loss(model, batch["tokens"], self.eod_id, reduction)

    def evaluate(self, model, autocast=None) -> float:
        return self.evaluator(model, autocast)


class _RandomTokens(RunData):
    """Uniform random windows of seq_len + 1 tokens drawn on the device: no host-to-device copy."""

    def __init__(self, vocab: int, local_batch: int, seq_len: int, generator, device):
        self.shape = (local_batch, seq_len + 1)
        self.vocab, self.generator, self.device = vocab, generator, device

    def batch(self, step: int) -> Batch:
        return {
            "tokens": torch.randint(0, self.vocab, self.shape, generator=self.generator, device=self.device)
        }

    def loss(self, model, batch: Batch, reduction: str = "mean") -> torch.Tensor:
        return lm_loss(model, batch["tokens"], None, reduction)


class CausalLM(Task):
    metric = Metric("validation log-perplexity (mean cross-entropy)", higher_is_better=False, unit="samples")
    settable = {"seq_len": "max_sequence_length"}

    def __init__(
        self,
        eod_mask_loss: bool = False,
        init_checkpoint_step: int | None = None,
        truncate_vocab: bool = False,
    ):
        self.eod_mask_loss = eod_mask_loss
        # The step the run starts from, where the reference logs it: continued pretraining
        # (closed_llama31_405b.yaml), and 0 from scratch (llama31_8b: pretrain_llama31.py:522; gpt_oss_20b:
        # primus_mllog mlperf_logger.py:83, `args.iteration`; deepseekv3_671b).
        self.init_checkpoint_step = init_checkpoint_step
        # The checkpoint's embedding and head keep only their first vocab_size rows (llama31_405b: the
        # Llama 3 checkpoint continued on Mixtral ids).
        self.truncate_vocab = truncate_vocab

    def data_name(self, tier) -> str:
        return f"c4-{tier.data.tokenizer}"

    def data_recipe(self, tier, source: Path) -> DataRecipe:
        """C4 tokenized with the tier's tokenizer, both splits: two `ttt data prepare c4` steps."""
        source = Path(source)
        c4 = sources.c4_dir(source)
        tokenizer = tier.data.tokenizer
        tok = ["--tokenizer", tokenizer]
        read = sorted(c4.glob("c4-*.json.gz"))
        if tokenizer != "llama3":  # llama3 ships with llama-models; the others are SentencePiece files
            model = sources.tokenizer_model(source, tokenizer)
            tok += ["--tokenizer-model", str(model)]
            read.append(model)
        steps = tuple(
            ("data", "prepare", "c4", "--src", str(c4), "--split", split, *tok, "--out", "{out}")
            for split in ("train", "validation")
        )
        return DataRecipe(self.data_name(tier), f"C4 tokenized with {tokenizer}", steps, tuple(read))

    def checkpoint_rows(self, tier) -> dict[str, int] | None:
        if not self.truncate_vocab:
            return None
        return {"embed.weight": tier.model.vocab_size, "head.weight": tier.model.vocab_size}

    def eval_every_steps(self, tier) -> int:
        if tier.data.floor_to_steps:
            return max(tier.eval_every_samples // tier.global_batch_size, 1)
        return tier.eval_every_steps

    def early_eval_step(self, tier) -> int | None:
        """The step of the evaluation the llama31_8b reference runs before its cadence, or None.
        small_llm_pretraining/nemo/pretrain_llama31.py:180 sets `trainer.val_check_interval = eval_every /
        GBS` with eval_every already ceil(12,288 / GBS) steps (:368, :383); Lightning's
        `_determine_batch_limits` keeps a value in [0, 1] as a fraction of the epoch, turns a larger whole
        number into that many batches and refuses anything else; the MLPerfCallback's `on_validation_start`
        (callbacks.py:211-213) then sets val_check_interval and val_check_batch to eval_every, so later
        evaluations fall on the multiples of eval_every. So at GBS 16, 32 and 64 the reference evaluates
        after step 48, 12 and 3 (768, 384 and 192 samples) and then every 768, 384, 192 steps. Elsewhere
        there is no early evaluation: a fraction (GBS 128: 0.75) puts it at 75% of a 1.2 M-step epoch and
        a fractional number of batches (GBS 48, 96) stops the reference before it starts."""
        if not tier.data.nemo_first_val_check:
            return None
        interval = self.eval_every_steps(tier) / tier.global_batch_size  # a float, as Python 3 divides
        if interval > 1 and interval % 1.0 == 0:
            return int(interval)
        return None

    def eval_due(self, tier, step: int) -> bool:
        return step == self.early_eval_step(tier) or super().eval_due(tier, step)

    def first_eval_step(self, tier) -> int:
        """With `skip_evals` (a, b), the reference skips the first k = floor(a * GBS + b) evaluations: its
        first validation is at eval_every_samples * k / GBS steps, then every `eval_every_steps`. Where
        that is not a whole step on the cadence (a GBS that does not divide the interval), the first
        evaluation is the first cadence step at or after it (decision: the loop evaluates on the cadence
        only). With `start_eval` (a, b), no evaluation before step a + b // GBS (Megatron-Bridge's
        `step >= start_eval_at_iter and step % eval_interval == 0`). An `early_eval_step` comes first."""
        early = self.early_eval_step(tier)
        if early is not None:
            return early
        every, gbs = self.eval_every_steps(tier), tier.global_batch_size
        start = every
        if tier.data.skip_evals is not None:
            a, b = tier.data.skip_evals
            skip = math.floor(a * gbs + b)
            start = max(-(-tier.eval_every_samples * skip // gbs), every)
        if tier.data.start_eval is not None:  # Megatron-Bridge: step >= start_eval_at_iter, on the cadence
            a, b = tier.data.start_eval
            start = max(start, a + b // gbs)
        return -(-start // every) * every

    def validate(self, tier) -> None:
        if tier.data.val_draw not in ("first", "megatron_cyclic"):
            raise ValueError(f"unknown val_draw {tier.data.val_draw!r}")
        if tier.data.seq_len <= 0:
            raise UserError(f"--set seq_len={tier.data.seq_len}: must be positive")
        if tier.data.seq_len > tier.model.max_seq_len:
            raise UserError(
                f"--set seq_len={tier.data.seq_len} exceeds the model's context {tier.model.max_seq_len}"
            )

    def resolve(self, tier, data_dir: Path, verify: bool = True, init_checkpoint=None):
        # A fixed eval set must fit in one pass over the validation file; a drawn one cycles through epochs.
        fixed = tier.data.val_draw == "first"
        res = loader.resolve(
            tier.data,
            data_dir,
            verify=verify,
            vocab_size=tier.model.vocab_size,
            eval_samples=self.eval_windows(tier) if fixed else None,
        )
        if tier.data.vocab_keep:  # before the clock: an EOD id narrowed away is bad data, not a run
            self._eod_id(tier, loader.vocab_table(res.counts_file, tier.data.vocab_keep))
        return res

    def open(self, tier, resolved, seed: int, share: Share, device: torch.device) -> RunData:
        data = tier.data
        table = loader.vocab_table(resolved.counts_file, data.vocab_keep) if data.vocab_keep else None
        eod_id = self._eod_id(tier, table)
        train = loader.open_train(resolved, data.seq_len, tier.max_steps * tier.global_batch_size, seed)
        source = loader.TokenSource(train, tier.global_batch_size, table, share.local, share.offset)
        return _TokenData(source, self._evaluator(tier, resolved, seed, share, device, table, eod_id), eod_id)

    def _evaluator(self, tier, resolved, seed, share: Share, device, table, eod_id) -> Evaluator:
        n, seq, micro = self.eval_windows(tier), tier.data.seq_len, tier.micro_batch_size
        if tier.data.val_draw == "first":
            windows = loader.open_val(resolved, seq, n)
            return Evaluator.fixed(windows, n, table, device, micro, share, eod_id)
        # Megatron-Bridge's cyclic validation sampler: rank r reads its share of each evaluation from its own
        # bucket, at the positions its stream has reached (data/cyclic_sampler.py).
        gbs = tier.global_batch_size
        want = reference_val_samples(tier.max_steps, self.eval_every_steps(tier), gbs)
        windows = loader.open_val_shuffled(resolved, seq, want, seed)
        sampler = CyclicDraw(len(windows), micro, share.rank, share.world)
        part = share.part(n)
        count = part.stop - part.start  # this rank's windows of each evaluation

        def draw(k: int):
            return sampler.indices(k * count, count)

        return Evaluator(windows, table, device, micro, share.world, eod_id, draw)

    def eval_windows(self, tier) -> int:
        """The windows one evaluation reads: `eval_samples`, or whole global batches covering them (or, with
        `floor_to_steps`, the whole global batches within them)."""
        n, gbs = tier.eval_samples, tier.global_batch_size
        if tier.data.floor_to_steps:
            return max(n // gbs, 1) * gbs
        return -(-n // gbs) * gbs if tier.data.eval_whole_batches else n

    def _eod_id(self, tier, table) -> int | None:
        """The end-of-document id as the model sees it, when the loss is masked after EOD."""
        if not self.eod_mask_loss:
            return None
        eos = EOS_IDS[tier.data.tokenizer]
        if table is None:
            return eos
        eod = int(table[eos])
        if eod == tier.data.vocab_keep:  # narrowed away: masking "other" would drop unrelated tokens
            raise UserError(
                f"end-of-document id {eos} is not among the {tier.data.vocab_keep} kept ids of this tier"
            )
        return eod

    def synthetic(self, tier, local_batch: int, generator, device) -> RunData:
        return _RandomTokens(tier.model.vocab_size, local_batch, tier.data.seq_len, generator, device)

    def flops_per_sample(self, family, tier) -> float:
        # Causal attention: the flash kernels skip the masked upper triangle, so only half the square counts
        # (and only the band for sliding-window layers).
        seq = tier.data.seq_len
        return seq * family.flops_per_token(tier.model, seq, causal=True)

    def sample_items(self, tier) -> tuple[str, int]:
        return "tokens", tier.data.seq_len

    def baseline_loss(self, tier) -> float:
        return math.log(tier.model.vocab_size)

    def hyperparameters(self, bench, tier, accum: int) -> list[tuple[str, object]]:
        hp = [
            ("global_batch_size", tier.global_batch_size),
            ("gradient_accumulation_steps", accum),
            ("max_sequence_length", tier.data.seq_len),
            ("max_steps", tier.max_steps),
            ("opt_base_learning_rate", tier.lr),
            ("opt_end_learning_rate", tier.end_lr),
            ("opt_learning_rate_warmup_steps", tier.warmup_steps),
            ("opt_learning_rate_decay_steps", tier.decay_steps),
        ]
        hp += bench.optimizer.log_keys()
        hp += [
            ("train_samples", tier.max_steps * tier.global_batch_size),
            ("eval_samples", tier.eval_samples),
        ]
        if self.init_checkpoint_step is not None:
            hp.append(("init_checkpoint_step", self.init_checkpoint_step))
        return hp
