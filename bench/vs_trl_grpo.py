"""One GRPO step, ours against TRL's `GRPOTrainer`, side by side in one process on the same model and batch shape.

The model: qwen35_397b_grpo tiny (a Qwen3.5-shaped hybrid, 318k parameters), the same random weights in both
(ours, and `transformers.Qwen3_5MoeForCausalLM` loaded from our `hf_export`). The step: 8 prompts x 8 generations
of the tiny tier's digit-reversal task (completions of at most 5 tokens at temperature 1), exact-answer
rewards, group advantages, the token-level policy-gradient loss, backward, clip and AdamW (lr 3e-4). Ours: the
colocated PyTorch rollout engine (qwen3_5_moe's cached decode) and the task's loss. TRL: GRPOTrainer with
beta 0 (no KL, as the reference), loss_type "dapo" (its token-level mean), one update per generation,
transformers' `generate` on CPU. Timed: the median step over --steps after one warm-up step; the figure is
the ratio of the two medians, measured in the same run. TRL needs a tokenizer: a character-level
`PreTrainedTokenizerFast` over the tier's 15 ids.

TRL is not a dependency: run it from an environment that has it (it installs with `pip install trl`; here it
was a venv with the system site-packages, so torch and transformers are the same ones):
    PYTHONPATH=. python bench/vs_trl_grpo.py --steps 6
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from timetotrain.data import arithmetic
from timetotrain.models.qwen3_5_moe import FAMILY
from timetotrain.spec.task import Share
from timetotrain.suite import qwen35_397b_grpo as Q
from timetotrain.tasks.envs import ExactAnswer
from timetotrain.tasks.grpo import _Rollouts

LR = 3e-4


def problems(n: int) -> list[arithmetic.Problem]:
    return arithmetic.draw(n, Q.DIGITS, random.Random(0), kind=Q.KIND)


def ours(model, train, steps: int) -> list[float]:
    data = _Rollouts(
        Q.TINY,
        train,
        train[:8],
        0,
        Share.of(Q.TINY.global_batch_size),
        torch.device("cpu"),
        Q.BENCHMARK.task.engine,
        ExactAnswer(),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    times = []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        batch = data.prepare(model, data.batch(step))
        loss = data.loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[1:]


def char_tokenizer():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(arithmetic.CHARS)}
    vocab.update({"<eos>": arithmetic.EOS, "<bos>": arithmetic.BOS, "<pad>": arithmetic.PAD})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", padding_side="left"
    )


def trl_steps(hf_model, train, steps: int) -> list[float]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class Clock(TrainerCallback):
        def __init__(self):
            self.t, self.times = None, []

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t)

    def reward(completions, answer, **kw):
        return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]

    ds = Dataset.from_list([{"prompt": "<bos>" + p.prompt, "answer": p.answer} for p in train])
    G = Q.TINY.data.generations
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out, per_device_train_batch_size=Q.TINY.global_batch_size, num_generations=G,
            max_completion_length=Q.TINY.data.max_new_tokens, learning_rate=LR, beta=0.0, loss_type="dapo",
            epsilon=0.2, epsilon_high=0.28, max_steps=steps + 1, lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=0.0, max_grad_norm=1.0, use_cpu=True, report_to="none", save_strategy="no",
            logging_steps=1000, temperature=1.0, top_p=1.0, disable_tqdm=True, seed=0, dataloader_num_workers=0,
            shuffle_dataset=False,
        )  # fmt: skip
        clock = Clock()
        trainer = GRPOTrainer(
            model=hf_model, reward_funcs=[reward], args=cfg, train_dataset=ds, processing_class=char_tokenizer(),
            callbacks=[clock],
        )  # fmt: skip
        trainer.train()
    return clock.times[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    cfg = Q.TINY_MODEL
    model = FAMILY.build(cfg)
    FAMILY.init(model, torch.Generator().manual_seed(0))
    # Through a checkpoint folder, as `ttt base` writes one: transformers fuses the per-expert tensors on load.
    state, config = FAMILY.hf_export({k: v.detach().clone() for k, v in model.state_dict().items()}, cfg)
    with tempfile.TemporaryDirectory() as folder:
        from safetensors.torch import save_file

        save_file(state, f"{folder}/model.safetensors", metadata={"format": "pt"})
        Path(folder, "config.json").write_text(json.dumps(config))
        hf = transformers.Qwen3_5MoeForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():  # the same function: logits of one batch agree
        x = torch.tensor([arithmetic.prompt_ids(p) for p in problems(4)])
        assert torch.allclose(model(x), hf(x).logits, atol=1e-4)
    hf.config.output_router_logits = False  # no router aux loss: the reference trains none (frozen router)
    hf.generation_config.eos_token_id = arithmetic.EOS
    hf.generation_config.pad_token_id = arithmetic.PAD
    train = problems(512)
    peer = trl_steps(hf, train, args.steps)
    mine = ours(model, train, args.steps)
    result = {
        "ours_step_s_median": statistics.median(mine),
        "trl_step_s_median": statistics.median(peer),
        "trl_over_ours": statistics.median(peer) / statistics.median(mine),
        "steps_timed": args.steps,
        "threads": args.threads,
        "trl": __import__("trl").__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "rollouts_per_step": Q.TINY.global_batch_size,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
