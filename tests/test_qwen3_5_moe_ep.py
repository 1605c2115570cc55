"""qwen3_5_moe sharded on gloo (2 processes, `ep=2,fsdp=2`: 4 experts per rank, the rest FSDP2-sharded), loaded
from a Hugging Face folder by `load_hf_checkpoint` into the shards: the logits and greedy decoding
(`generate(..., all_steps=True)`, the same number of forwards on every rank, as the all-to-alls need) equal one
process loading the same folder; the family's init on the shards (`shards.full_init`, as the sharded build
runs it) gives the one-process model's weights bit for bit. Each rank decodes its own prompts (different lengths and batch sizes), so the
expert all-to-alls carry uneven loads."""

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from timetotrain.models import qwen3_5_moe as q
from timetotrain.models.qwen3_5_moe.generate import generate
from timetotrain.models.qwen3_5_moe.hf import hf_export, hf_mapping
from timetotrain.train import expert_parallel, parallel
from timetotrain.train.checkpoint import load_hf_checkpoint
from timetotrain.train.shards import full_init

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # every test reads the gloo runs' fixture

WORLD = 2
CFG = q.Qwen35MoeConfig(
    dim=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, lin_k_heads=2, lin_v_heads=4, lin_k_dim=8,
    lin_v_dim=12, n_experts=8, top_k=2, expert_ffn_dim=16, shared_ffn_dim=24, vocab_size=96, max_seq_len=96,
    init_std=0.1,
)  # fmt: skip
PROMPTS = [[[5, 6, 7], [9] * 11, [1, 2]], [[40, 41, 42, 43, 44, 45, 46]]]  # rank 0's, rank 1's
NEW = 10


def _tokens() -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, 70), generator=torch.Generator().manual_seed(1))


def _run(model, rank: int) -> dict:
    with torch.no_grad():
        logits = model(_tokens()).detach().clone()
    completions, _ = generate(model, PROMPTS[rank], max_new_tokens=NEW, temperature=0.0, all_steps=True)
    return {"logits": logits, "completions": completions}


PLAN = parallel.Plan(fsdp=WORLD, ep=WORLD)
INIT_SEED = 7


def _sharded_model():
    with torch.device("meta"):
        model = q.Qwen35Moe(CFG)
    model, _ = parallel.apply(model, PLAN, torch.device("cpu"), q.FAMILY)
    model.to_empty(device="cpu")
    parallel.remark(model, PLAN)
    return model


def _full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter as its whole tensor: FSDP2 shards and expert slices gathered (collectives)."""
    experts = expert_parallel.expert_dtensors(model)
    out = {}
    for n, p in model.named_parameters():
        t = experts.get(n, p)
        out[n] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
    return out


def _worker(rank: int, root: str) -> None:
    torch.set_num_threads(1)
    root = Path(root)
    dist.init_process_group(
        "gloo", init_method=f"file://{root / 'store'}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        fresh = _sharded_model()
        with full_init():
            q.FAMILY.init(fresh, torch.Generator().manual_seed(INIT_SEED))
        init = _full_state(fresh)
        model = _sharded_model()
        report = load_hf_checkpoint(model, root / "hf", hf_mapping(CFG))
        out = {
            "init": init,
            "ignored": report.ignored,
            "local_experts": model.layers[0].ffn.experts.w1.shape[0],
            "sharded": isinstance(model.layers[0].attn.in_proj.weight, DTensor),
            **_run(model.eval(), rank),
        }
        torch.save(out, root / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-ep")
    torch.manual_seed(3)
    base = q.Qwen35Moe(CFG)
    state, _ = hf_export({k: v.detach() for k, v in base.state_dict().items()}, CFG)
    (root / "hf").mkdir()
    save_file(state, root / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        mp.spawn(_worker, args=(str(root),), nprocs=WORLD, join=True)
    one = q.Qwen35Moe(CFG).eval()
    load_hf_checkpoint(one, root / "hf", hf_mapping(CFG))
    single = [_run(one, rank) for rank in range(WORLD)]
    q.FAMILY.init(one, torch.Generator().manual_seed(INIT_SEED))
    init = {n: p.detach() for n, p in one.named_parameters()}
    return single, init, [torch.load(root / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def test_sharded_init_equals_one_process(results):
    _, init, ranks = results
    for got in ranks:
        assert got["init"].keys() == init.keys()
        for name, t in init.items():
            assert torch.equal(got["init"][name], t), name


def test_sharded_load_forward_and_decode_equal_one_process(results):
    single, _, ranks = results
    for rank, got in enumerate(ranks):
        assert got["ignored"] == []
        assert got["local_experts"] == CFG.n_experts // WORLD and got["sharded"]
        torch.testing.assert_close(got["logits"], single[rank]["logits"], rtol=1e-5, atol=1e-5)
        assert got["completions"] == single[rank]["completions"]
        assert [len(c) for c in got["completions"]] == [NEW] * len(PROMPTS[rank])
