"""What `ttt plan`'s search offers across nodes (timetotrain/train/memory.py, docs/scale.md "The plan across
nodes"): HSDP (`dp_replicate=R,fsdp=S`, S the GPUs of a node) where FSDP2 within a node fits, and, where the
tier's GBS splits over no layout without tensor parallelism, the rows of a legal GBS of the benchmark's RCP
table, each row saying its GBS, beside the suggestion at the tier's GBS; pipeline with expert parallelism
where nothing else splits the batch."""

import dataclasses
import json

import pytest

from timetotrain.cli import main
from timetotrain.spec.registry import get
from timetotrain.train.memory import expert_params, plan

LLAMA = get("llama31_8b")
REF = LLAMA.tier("reference")


def test_hsdp_is_suggested_across_nodes_where_a_node_holds_the_shards():
    # 2 nodes of 8: FSDP2 within each node fits (15 GiB of states), so its all-gathers stay on the node
    _, rows, best = plan(LLAMA, REF, 16, 80, None)
    assert best.parallel == "dp_replicate=2,fsdp=8" and not best.ac
    assert {r.parallel for r in rows} >= {"fsdp=16", "dp_replicate=2,fsdp=8"}
    # one node of 16: nothing to keep off the network, FSDP2 over all of it
    _, rows, best = plan(LLAMA, REF, 16, 80, None, gpus_per_node=16)
    assert best.parallel == "fsdp=16" and not any(r.parallel.startswith("dp_replicate") for r in rows)
    # 24 GiB: a node's shards (15 GiB of states) no longer fit beside the activations; fsdp=16's do
    _, rows, best = plan(LLAMA, REF, 16, 24, None)
    assert best.parallel == "fsdp=16" and best.ac
    assert all(r.total > 0.9 * 24 * 2**30 for r in rows if r.parallel.startswith("dp_replicate"))


def test_64_gpus_offer_a_legal_gbs_of_the_rcp_table(capsys):
    """`ttt plan llama31_8b --tier reference --gpus 64`: the tier's GBS 16 splits over no 64 data-parallel
    ranks, so the suggestion is TP at GBS 16 (the plan's rule keeps the tier's GBS where a layout fits), as
    HSDP x TP (TP and FSDP2 within each node, replicated over the 8 nodes) before TP x FSDP over all 64;
    beside it, the rows of GBS 64 (the RCP table's smallest larger GBS where a layout without TP fits),
    among them HSDP within each node, each row naming its GBS."""
    argv = ["plan", "llama31_8b", "--tier", "reference", "--gpus", "64", "--gpu-mem", "80"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["suggestion"]["parallel"] == "dp_replicate=8,fsdp=2,tp=4" and doc["global_batch_size"] == 16
    tp_rows = {r["parallel"]: r for r in doc["rows"] if r["fits"] == "yes" and r["global_batch_size"] == 16}
    assert "tp=4,fsdp=16" in tp_rows  # offered too; HSDP x TP holds more (states over 2 GPUs, not 16)
    hsdp_tp = tp_rows["dp_replicate=8,fsdp=2,tp=4"]
    assert hsdp_tp["states_gib"] > tp_rows["tp=4,fsdp=16"]["states_gib"]
    legal = set(LLAMA.rcp_hparams)
    assert all(r["global_batch_size"] in legal for r in doc["rows"])
    other = [r for r in doc["rows"] if r["global_batch_size"] != 16 and r["fits"] == "yes"]
    assert other and {r["global_batch_size"] for r in other} == {64}
    assert {r["parallel"] for r in other} == {"fsdp=64", "dp_replicate=8,fsdp=8"}
    assert all("tp=" not in r["parallel"] for r in other)

    assert main(argv) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("parallel"))
    assert header.split()[:4] == ["parallel", "AC", "micro", "GBS"]
    row = next(line for line in text.splitlines() if line.startswith("dp_replicate=8,fsdp=8 "))
    assert row.split()[3] == "64" and row.split()[-1] == "yes"
    assert "GBS 64 rows: a legal GBS of the RCP table" in text and "--set global_batch_size=N" in text


def test_no_other_gbs_where_the_tier_gbs_splits_without_tp():
    # 8 GPUs: GBS 16 splits over fsdp=8, so every row is at the tier's GBS
    _, rows, best = plan(LLAMA, REF, 8, 80, None)
    assert best.parallel == "fsdp=8" and {r.gbs for r in rows} == {16}


def test_hsdp_with_tp_or_ep_counts_a_shard_group():
    """`dp_replicate=R,fsdp=S,tp=T` holds `tp=T,fsdp=S`'s states on T x S GPUs (FSDP2 shards over S only)
    beside the activations of R x S data-parallel ranks; `dp_replicate=R,fsdp=S,ep=E` `ep=E,fsdp=S`'s, less
    the sharding of the expert slices over their replicas, which HSDP keeps whole (train/parallel.py)."""
    rows = {r.ac: r for r in plan(LLAMA, REF, 16, 80, "dp_replicate=2,fsdp=4,tp=2")[1] if r.micro_batch == 1}
    node = {r.ac: r for r in plan(LLAMA, REF, 8, 80, "tp=2,fsdp=4")[1] if r.micro_batch == 1}
    wide = {r.ac: r for r in plan(LLAMA, REF, 16, 80, "tp=2,fsdp=8")[1] if r.micro_batch == 1}
    assert rows[1].parallel == "dp_replicate=2,fsdp=4,tp=2"
    assert rows[1].states == node[1].states > wide[1].states and rows[1].activations == wide[1].activations
    gpt = get("gpt_oss_20b")
    ref = gpt.tier("reference")
    hsdp_ep = plan(gpt, ref, 16, 80, "dp_replicate=2,fsdp=8,ep=4")[1][0]
    assert hsdp_ep.parallel == "dp_replicate=2,ep=4,fsdp=8"
    n, (experts, _) = gpt.family.param_count(ref.model), expert_params(gpt.family, ref.model)
    assert hsdp_ep.states == pytest.approx(16 * ((n - experts) / 8 + experts / 4))
    assert plan(gpt, ref, 8, 80, "ep=4,fsdp=8")[1][0].states == pytest.approx(16 * n / 8)


def test_pipeline_with_expert_parallelism_is_searched_for_moe():
    """The search's last resort for an MoE family is `pp=P,ep=E,fsdp=F` (train/memory.py
    `_pipeline_search_rows`, E the largest dividing the experts and a stage's F ranks), through `ttt run`'s
    preflight checks. Planted: DeepSeek-V3 reference at GBS 768 on 512 single-GPU nodes (no TP or CP within a
    node) splits over no 512 data-parallel ranks, but over a stage's 256 or 128: pp=2 (97 GiB) does not fit
    80 GiB, pp=4 does, and the search stops there. Where the tier's GBS splits, the pp rows are tried where
    nothing else fits and fit no better: a stage holds 1/P of the layers on 1/P of the GPUs, the same states
    per GPU, plus its gradients whole (64 x 80 GiB: the least of them 249 GiB)."""
    bench = get("deepseekv3_671b")
    ref = bench.tier("reference")
    tier = dataclasses.replace(ref, global_batch_size=768)
    cap = 0.9 * 80 * 2**30
    _, rows, best = plan(bench, tier, 512, 80, None, gpus_per_node=1)
    assert {r.parallel for r in rows} == {"pp=2,ep=256,fsdp=256", "pp=4,ep=128,fsdp=128"}
    assert not any(r.total <= cap for r in rows if r.parallel.startswith("pp=2,"))
    assert (best.parallel, best.ac, best.micro_batch) == ("pp=4,ep=128,fsdp=128", 1, 1) and best.total <= cap
    # the row is the one --parallel names
    named = plan(bench, tier, 512, 80, "pp=4,ep=128,fsdp=128", gpus_per_node=1)[1]
    assert [r.total for r in named] == [r.total for r in rows if r.parallel.startswith("pp=4,")]
    # gpt_oss too: GBS 24 on 16 single-GPU nodes
    oss = get("gpt_oss_20b")
    tier = dataclasses.replace(oss.tier("reference"), global_batch_size=24)
    best = plan(oss, tier, 16, 80, None, gpus_per_node=1)[2]
    assert (best.parallel, best.ac, best.micro_batch) == ("pp=2,ep=8,fsdp=8", 1, 1)
    # the reference at its GBS on 64 x 80 GiB: pp with ep is estimated, and fits no better than without
    _, rows, best = plan(bench, ref, 64, 80, None)
    pp = [r for r in rows if r.parallel.startswith("pp=")]
    assert best is None and pp and min(r.total for r in pp) > 240 * 2**30
    assert all(",ep=" in r.parallel for r in pp)
