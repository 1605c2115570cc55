"""The sharded build (`step.build_training` under fsdp=N, `_build_sharded`) on 2 gloo ranks against the
whole-model build in one process, for llama2_70b_lora on a small random Llama:

- from a Hugging Face checkpoint (and from a ttt checkpoint of the same base): the same full tensors, base
  and adapters, and the same first training losses at fp32 tolerance; from the seed alone (no checkpoint):
  the same full tensors as the family's init gives unsharded;
- memory: every parameter is a DTensor before `to_empty` allocates anything, each rank holds about half of
  the parameters, and the transient full tensors (init, loading) are never larger than one parameter;
- `--precision bf16`: the frozen base is stored in bf16 (norms and adapters fp32), under activation
  checkpointing; only the adapters get gradients and optimizer state; the loss stays close to fp32's.

Run as a script (by torchrun) this file is the worker; it writes what it saw to a file per rank."""

import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import free_port, random_hf_llama, small_llama
from forked import run_ranks

from timetotrain.spec.registry import get
from timetotrain.tasks.lora_sft import LoRAData, lm_block_loss

pytestmark = pytest.mark.distributed

BENCH = get("llama2_70b_lora")
CFG = small_llama(rope_theta=10_000.0, rope_scaling=None, vocab_size=255)  # odd rows: uneven shards
STEPS, GBS, BLOCK = 3, 4, 33


def tier():
    """The reference tier at a small shape, dropout 0: dropout masks depend on the world size (each rank
    draws its own), so the curves of 1 and 2 processes could not match with it."""
    return dataclasses.replace(
        BENCH.tier("reference"), model=CFG, data=LoRAData(block=BLOCK, train_samples=8, dropout=0.0),
        global_batch_size=GBS, micro_batch_size=GBS, eval_samples=2, max_steps=10, eval_every_samples=8,
    )  # fmt: skip


def batches(rank: int, world: int) -> list[dict]:
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, CFG.vocab_size, (GBS, BLOCK), generator=g).chunk(world)[rank]
        out.append({"input_ids": ids, "labels": ids})
    return out


def loss_fn(model, batch):
    return lm_block_loss(model, batch["input_ids"], batch["labels"])


def train(tr, rank: int, world: int) -> list[float]:
    return [tr.step(s, b, 1, loss_fn)[0].item() for s, b in enumerate(batches(rank, world))]


def named(model) -> dict[str, torch.nn.Parameter]:
    """Parameters by name without the activation-checkpointing wrapper level."""
    return {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in model.named_parameters()}


def full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in named(model).items()
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A small random HF Llama saved in 2 safetensors files, and the same base as a ttt checkpoint."""
    from timetotrain.models.llama import Llama
    from timetotrain.train.checkpoint import load_hf_checkpoint, save_checkpoint

    root = tmp_path_factory.mktemp("sharded_build")
    random_hf_llama(CFG).save_pretrained(root / "hf", safe_serialization=True, max_shard_size=150_000)
    assert len(list((root / "hf").glob("*.safetensors"))) > 1
    with torch.device("meta"):
        base = Llama(CFG)
    base.to_empty(device="cpu")
    load_hf_checkpoint(base, root / "hf", BENCH.family.hf_mapping(CFG))
    save_checkpoint(root / "ttt", base, None, step=0)
    return root


@pytest.fixture(scope="module")
def sharded(checkpoints):
    """One torchrun of the worker (all scenarios), its per-rank results and its wall time."""
    out = checkpoints / "out"
    out.mkdir()
    t0 = time.monotonic()
    run_ranks(__file__, [str(checkpoints)], 2, free_port())
    seconds = time.monotonic() - t0
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    print(f"sharded build worker: {seconds:.1f} s for 2 ranks, all scenarios")
    return ranks, torch.load(out / "full.pt")


def whole(init_checkpoint=None, precision="fp32"):
    from timetotrain.train import parallel
    from timetotrain.train.step import build_training

    torch.manual_seed(0)
    plan = parallel.Plan(precision=precision)
    return build_training(BENCH, tier(), torch.device("cpu"), 5, plan, init_checkpoint)


@pytest.mark.slow
def test_sharded_build_loads_and_trains_as_one_process(checkpoints, sharded):
    ranks, full = sharded
    tr = whole(checkpoints / "hf")
    expected = full_state(tr.bare)
    losses = train(tr, 0, 1)
    for case in ("hf", "ttt"):
        got = full[case]
        assert got.keys() == expected.keys()
        for name, t in expected.items():  # base from the checkpoint, adapters from the seed: bit for bit
            assert torch.equal(got[name], t), (case, name)
        assert ranks[0][case]["losses"] == ranks[1][case]["losses"]
        torch.testing.assert_close(
            torch.tensor(ranks[0][case]["losses"]), torch.tensor(losses), rtol=1e-5, atol=0
        )
    assert any(t.abs().sum() > 0 for n, t in expected.items() if ".lora_A." in n)
    # Without a checkpoint the family's init, drawn per full tensor, equals the unsharded init.
    seeded = full_state(whole().bare)
    assert all(torch.equal(full["seed"][n], t) for n, t in seeded.items())


@pytest.mark.slow
def test_each_rank_allocates_only_its_shards(sharded):
    ranks, _ = sharded
    n_params = sum(p.numel() for p in whole().bare.parameters())
    biggest = max(p.numel() for p in whole().bare.parameters())
    for r in ranks:
        mem = r["hf"]["memory"]
        assert mem["all_sharded_at_to_empty"] and mem["to_empty_calls"] == 1
        assert mem["total_numel"] == n_params
        # Half of every parameter, give or take the row an odd dim 0 puts on rank 0.
        assert abs(mem["local_numel"] - n_params / 2) < 0.01 * n_params
        assert 0 < mem["largest_full_numel"] <= biggest  # one parameter's full tensor at a time
    assert sum(r["hf"]["memory"]["local_numel"] for r in ranks) == n_params
    print("local shard numel per rank:", [r["hf"]["memory"]["local_numel"] for r in ranks], "of", n_params)
    print(
        "local bytes per rank, fp32 / bf16 base:",
        [(r["hf"]["memory"]["local_bytes"], r["bf16"]["memory"]["local_bytes"]) for r in ranks],
    )


@pytest.mark.slow
def test_bf16_base_stores_frozen_weights_in_bf16(checkpoints, sharded):
    ranks, full = sharded
    fp32 = ranks[0]["hf"]["losses"]
    for r in ranks:
        bf16 = r["bf16"]
        dtypes = bf16["dtypes"]
        assert dtypes["layers.0.attn.qkv.base.weight"] == dtypes["embed.weight"] == "torch.bfloat16"
        assert dtypes["head.weight"] == dtypes["layers.1.ffn.fc1.weight"] == "torch.bfloat16"
        assert dtypes["layers.0.attn_norm.weight"] == dtypes["norm.weight"] == "torch.float32"
        assert dtypes["layers.0.attn.qkv.lora_A.weight"] == dtypes["layers.1.attn.proj.lora_B.weight"]
        assert dtypes["layers.1.attn.proj.lora_B.weight"] == "torch.float32"
        assert bf16["grads"] == bf16["optimizer_state"] == bf16["adapters"]
        assert bf16["grad_dtypes"] == ["torch.float32"]
        # 2 bytes saved per frozen matrix element (most of a 70B model; here the adapters are 9%).
        mem, fp32_mem = bf16["memory"], r["hf"]["memory"]
        assert mem["local_bytes"] == fp32_mem["local_bytes"] - 2 * mem["frozen_matrix_numel"]
        assert mem["frozen_matrix_numel"] > 0.9 * mem["local_numel"]
        for a, b in zip(bf16["losses"], fp32, strict=True):
            assert a == pytest.approx(b, rel=2e-2)
    # The same bf16 weights as the whole-model build, with an unsharded bf16 base (DDP/one process).
    tr = whole(checkpoints / "hf", precision="bf16")
    assert tr.bare.layers[0].attn.qkv.base.weight.dtype == torch.bfloat16
    assert all(torch.equal(full["bf16"][n], t) for n, t in full_state(tr.bare).items())


def _worker(root: Path) -> None:
    """Each scenario builds with fsdp=2 and trains STEPS steps; rank 0 saves the gathered full tensors."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from timetotrain.train import parallel, shards
    from timetotrain.train.step import build_training

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    memory = {"to_empty_calls": 0, "all_sharded_at_to_empty": True, "largest_full_numel": 0}
    real_to_empty, real_copy_full = torch.nn.Module.to_empty, shards.copy_full

    def to_empty(module, *args, **kwargs):
        if module.__class__.__name__.startswith("FSDP"):  # the root: what is allocated is what is sharded
            memory["to_empty_calls"] += 1
            memory["all_sharded_at_to_empty"] &= all(isinstance(p, DTensor) for p in module.parameters())
        return real_to_empty(module, *args, **kwargs)

    def copy_full(param, full):
        memory["largest_full_numel"] = max(memory["largest_full_numel"], full.numel())
        return real_copy_full(param, full)

    torch.nn.Module.to_empty = to_empty
    shards.copy_full = copy_full
    import timetotrain.train.checkpoint as ckpt

    ckpt.copy_full = copy_full

    results, full = {}, {}
    scenarios = {
        "hf": (root / "hf", parallel.Plan(fsdp=2)),
        "ttt": (root / "ttt", parallel.Plan(fsdp=2)),
        "seed": (None, parallel.Plan(fsdp=2)),
        "bf16": (root / "hf", parallel.Plan(fsdp=2, precision="bf16", activation_checkpointing=True)),
    }
    for case, (init, plan) in scenarios.items():
        torch.manual_seed(0)
        tr = build_training(BENCH, tier(), torch.device("cpu"), 5, plan, init)
        params = named(tr.bare)
        res = {
            "memory": {
                **memory,
                "total_numel": sum(p.numel() for p in params.values()),
                "local_numel": sum(p.to_local().numel() for p in params.values()),
                "local_bytes": sum(p.to_local().nbytes for p in params.values()),
                "frozen_matrix_numel": sum(
                    p.to_local().numel() for p in params.values() if p.dim() >= 2 and not p.requires_grad
                ),
            },
            "dtypes": {n: str(p.dtype) for n, p in params.items()},
            "adapters": sorted(n for n, p in params.items() if p.requires_grad),
        }
        full[case] = full_state(tr.bare)
        if case == "bf16":  # one backward by hand, to see the gradients before the step clears them
            loss_fn(tr.model, batches(rank, world)[0]).backward()
            res["grads"] = sorted(n for n, p in params.items() if p.grad is not None)
            res["grad_dtypes"] = sorted({str(p.grad.dtype) for p in params.values() if p.grad is not None})
            tr.model.zero_grad(set_to_none=True)
        res["losses"] = train(tr, rank, world)
        if case == "bf16":
            ids = {id(p): n for n, p in params.items()}
            res["optimizer_state"] = sorted(ids[id(p)] for p in tr.opt.state)
        results[case] = res
        memory.update(to_empty_calls=0, all_sharded_at_to_empty=True, largest_full_numel=0)
    (root / "out" / f"rank{rank}.json").write_text(json.dumps(results))
    if rank == 0:
        torch.save(full, root / "out" / "full.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
