"""Expert stacks drawn an expert at a time (models/common/rows.py `by_rows`, train/shards.py `full_init`):

- one process, on the CPU: every tiny MoE family's initial weights equal those of the whole-stack draw it
  replaced, bit for bit (each stack's rows hold a multiple of 16 elements, asserted: torch's CPU `normal_`
  turns uniforms into normals in blocks of 16);
- sharded, on 3 gloo ranks (uneven cuts): a rank's part of a stack drawn under `full_init` equals its part
  of the whole draw for each way a layout cuts a stack (FSDP2's Shard(0), Shard(1) as train/expert_fsdp.py
  cuts, Shard(2), Replicate, an expert slice, an expert slice FSDP2 shards on dim 0 or 1, and a
  tensor-parallel row order that falls back to the whole stack), the generator ends where the whole draw
  leaves it, and the largest tensor the draw allocates (simulate's `_Allocations`) is one expert, where it
  was the stack; a pipeline's draw for another rank's stage keeps nothing and allocates one expert too.

Run as a script (by torchrun) this file is the worker."""

import sys

import pytest
import torch
from conftest import free_port
from forked import run_ranks
from torch import nn

from timetotrain.models.common.moe import layer as moe_layer
from timetotrain.spec.registry import get

pytestmark = pytest.mark.distributed

WORLD, E, A, B = 3, 5, 6, 8  # 5 experts over 3 ranks: rows 2, 2, 1


@pytest.mark.parametrize("name", ["deepseekv3_671b", "gpt_oss_20b", "qwen35_397b_grpo"])
def test_one_process_weights_equal_the_whole_draw(name, monkeypatch):
    bench = get(name)
    cfg = bench.tier("tiny").model

    def initialised() -> dict[str, torch.Tensor]:
        model = bench.family.build(cfg)
        bench.family.init(model, torch.Generator().manual_seed(7))
        return model.state_dict()

    rows = initialised()
    monkeypatch.setattr(moe_layer, "by_rows", lambda init, t, *a, **k: init(t, *a, **k))  # the whole draw
    whole = initialised()
    stacks = [k for k in rows if k.endswith(("experts.w1", "experts.w2"))]
    assert stacks and all(rows[k][0].numel() % 16 == 0 for k in stacks)
    assert rows.keys() == whole.keys()
    assert all(torch.equal(rows[k], whole[k]) for k in rows), [
        k for k in rows if not torch.equal(rows[k], whole[k])
    ]


@pytest.mark.slow
def test_sharded_stacks_keep_their_part_of_each_expert():
    run_ranks(__file__, [], nproc=WORLD, port=free_port(), timeout=120)


def _worker() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from timetotrain.models.common.rows import by_rows
    from timetotrain.train import shards
    from timetotrain.train.expert_parallel import _SHARDED
    from timetotrain.train.simulate import _Allocations
    from timetotrain.train.tensor_parallel import STACKED

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (WORLD,))
    rank, row_bytes = dist.get_rank(), A * B * 4

    def dtensor(shape, placements) -> DTensor:
        return distribute_tensor(torch.empty(shape), mesh, placements, src_data_rank=None)

    def expert_slice(p):
        setattr(p, _SHARDED, (E, 2))  # rows 2 and 3 of the 5 (every rank its own slice in a real run)
        return p

    def tp_rows(p):
        setattr(p, STACKED, (1, WORLD))  # a tensor-parallel row order: local_shard copies, no geometry
        return p

    cases = {
        "Shard(0)": (dtensor((E, A, B), [Shard(0)]), row_bytes),
        "Shard(1)": (dtensor((E, A, B), [Shard(1)]), row_bytes),
        "Shard(2)": (dtensor((E, A, B), [Shard(2)]), row_bytes),
        "Replicate": (dtensor((E, A, B), [Replicate()]), E * row_bytes),  # the local tensor is the stack
        "slice": (expert_slice(torch.empty(2, A, B)), row_bytes),
        "slice Shard(0)": (expert_slice(dtensor((2, A, B), [Shard(0)])), row_bytes),
        "slice Shard(1)": (expert_slice(dtensor((2, A, B), [Shard(1)])), row_bytes),
        "TP rows (whole stack)": (tp_rows(dtensor((E, A, B), [Shard(0)])), E * row_bytes),
    }
    for what, (p, most) in cases.items():
        g = torch.Generator().manual_seed(rank + 1)  # any seed: the ranks' draws need not agree here
        whole = nn.init.normal_(torch.empty(shards.full_shape(p)), 0.0, 0.1, generator=g)
        after = torch.randn(4, generator=g)
        g.manual_seed(rank + 1)
        counted = _Allocations(torch.device("cpu"))
        with shards.full_init(), counted:
            by_rows(lambda t, s, g=g: nn.init.normal_(t, 0.0, s, generator=g), p, 0.1)
        local = p.to_local() if isinstance(p, DTensor) else p
        assert torch.equal(local, shards.local_shard(whole, p)), what
        assert torch.equal(torch.randn(4, generator=g), after), what
        # one expert, or the local shard itself where it is larger (its alias `to_local` returns is counted)
        assert counted.largest <= max(most, local.numel() * 4), f"{what}: {counted.shape}"
        if what.startswith("TP"):
            assert shards.row_part(p) is None
        else:
            assert shards.row_part(p) is not None, what

    # Another pipeline stage's stack (meta): drawn and dropped an expert at a time, the generator advanced.
    g = torch.Generator().manual_seed(5)
    nn.init.normal_(torch.empty(E, A, B), 0.0, 0.1, generator=g)
    after = torch.randn(4, generator=g)
    g.manual_seed(5)
    counted = _Allocations(torch.device("cpu"))
    with counted:
        shards.draw_dropped(
            by_rows, (lambda t, s: nn.init.normal_(t, 0.0, s, generator=g), torch.empty(E, A, B, device="meta"), 0.1),
            {}, torch.empty(E, A, B, device="meta"), torch.device("cpu"),
        )  # fmt: skip
    assert torch.equal(torch.randn(4, generator=g), after)
    assert counted.largest == row_bytes, counted.shape
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(_worker())
