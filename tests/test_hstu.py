"""The hstu family against an independent transcription of the dlrmv4 reference's PyTorch path
(mlcommons/training PR #889, recommendation_v4/generative_recommenders): the jagged attention, the STU stack
and the whole forward/backward, written below loop-per-sample from pt_hstu_attention.py, hstu_compute.py,
pt_hstu_linear.py, preprocessors.py, action_encoder.py, pt_position.py, postprocessors.py, dlrm_hstu.py and
multitask_module.py, equal ours at 1e-5 in fp32. (The reference's own modules do not import here: they load
fbgemm_gpu's jagged ops, Triton and TorchRec at import.) Also: the FLOP count the reference states (315.7
GFLOP per sample), the meta build at the reference shape, row-wise Adagrad on the tables, the collate."""

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from timetotrain.models import hstu
from timetotrain.models.hstu.attention import hstu_attention
from timetotrain.models.hstu.jagged import SequenceLayout
from timetotrain.train.adagrad import SparseAdagrad

CFG = hstu.HSTUConfig(
    tables=hstu.tiny_tables(40, 24),
    table_dim=12,
    dim=16,
    heads=2,
    linear_dim=8,
    qk_dim=6,  # unlike linear_dim: a U/V/Q/K split in the wrong order fails
    layers=2,
    preprocessor_hidden=10,
    max_seq_len=64,
    input_dropout=0.0,
    linear_dropout=0.0,
    mlp_hidden=14,
    position_buckets=14,  # below the longest history: the clamp at the last bucket is exercised
    time_buckets=24,
)


@pytest.fixture(autouse=True)
def _one_thread():
    """The shapes here are tiny: a second intra-op thread only adds its hand-offs (measured on 2 loaded
    cores: the file takes 89 s on 2 threads, 12 s on 1). conftest puts the count back after each test."""
    torch.set_num_threads(1)


T0 = 20_000_000  # seconds: timestamps as large as Yambda's (~300 days), past float32's exact integers


def _samples(seed, hist=(3, 9, 12, 5), cands=(1, 3, 2, 1), cfg=CFG):
    """Per-sample features as the reference's dataset builds its two KJTs (dlrm_v4/datasets/yambda.py
    _build_sample), as {name: (values, lengths)}; a few extra keys the model must ignore."""
    rng = np.random.default_rng(seed)
    f, sizes = cfg.features, dict(cfg.tables)
    out = []
    for n, c in zip(hist, cands, strict=True):
        uih = {name: (rng.integers(0, sizes[name], 1), 1) for name in f.contextual}
        cand = {}
        for u, cn, table in f.sequence:
            uih[u] = (rng.integers(0, sizes[table], n), n)
            cand[cn] = (rng.integers(0, sizes[table], c), c)
        ts = T0 + np.cumsum(rng.integers(1, 200_000, n))
        uih[f.action] = (rng.integers(0, 8, n), n)
        uih[f.timestamp] = (ts, n)
        uih["dummy_watch_time"] = (np.zeros(n, dtype=np.int64), n)
        uih["dummy_query_time"] = (ts[-1:], 1)
        cand[f.query_time] = (np.full(c, ts[-1] + int(rng.integers(0, 5000))), c)
        cand[f.candidate_action] = (rng.integers(0, 8, c), c)
        cand["item_dummy_watchtime"] = (np.ones(c, dtype=np.int64), c)
        out.append((uih, cand))
    return out


def _model(seed=0, cfg=CFG):
    model = hstu.HSTU(cfg)
    hstu.init(model, torch.Generator().manual_seed(seed))
    return model


# ---- the reference, transcribed per sample ---------------------------------------------------------------


def _ln(x, w, b, eps):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def _mlp(x, seq):
    """Linear -> x * sigmoid(LN(x)) -> Linear [-> LN], parameters read by position (the reference's
    nn.Sequential of Linear, SwishLayerNorm, Linear, LayerNorm)."""
    lin1, swish, lin2 = seq[0], seq[1], seq[2]
    h = x @ lin1.weight.T + lin1.bias
    h = h * torch.sigmoid(_ln(h, swish.weight, swish.bias, 1e-5))
    h = h @ lin2.weight.T + lin2.bias
    if len(seq) > 3:
        h = _ln(h, seq[3].weight, seq[3].bias, 1e-5)
    return h


def _ref_mask(s, nt, n_pad):
    """_get_valid_attn_mask (pt_hstu_attention.py), causal, contextual_seq_len 0, max_attn_len 0, over the
    padded length, for one sample."""
    ids = torch.arange(n_pad).view(1, n_pad)
    max_ids = torch.tensor([s]).view(-1, 1, 1) - torch.tensor([nt]).view(-1, 1, 1)
    ids = torch.clamp(ids, max=max_ids)
    row = ids.view(-1, n_pad, 1).expand(-1, n_pad, n_pad)
    col = ids.view(-1, 1, n_pad).expand(-1, n_pad, n_pad)
    valid = torch.eye(n_pad, dtype=torch.bool).view(1, n_pad, n_pad)
    return torch.logical_or(valid, (row - col) > 0)[0]


def _ref_attention(q, k, v, lengths, num_targets, alpha):
    """pytorch_hstu_mha, one sample at a time: q, k [T, H, A], v [T, H, V] -> [T, H, V]."""
    n_pad = int(max(lengths))
    out, at = [], 0
    for s, nt in zip(lengths, num_targets, strict=True):
        qi, ki, vi = (x[at : at + s].transpose(0, 1) for x in (q, k, v))  # [H, s, .]
        a = torch.einsum("hxa,hya->hxy", qi, ki) * alpha
        a = F.silu(a) / n_pad
        a = a * _ref_mask(s, nt, n_pad)[:s, :s].unsqueeze(0)
        out.append(torch.einsum("hxy,hyv->hxv", a, vi).transpose(0, 1))
        at += s
    return torch.cat(out)


def _ref_stu(layer, x, lengths, num_targets):
    """STULayer.forward through hstu_compute_uqvk, hstu_mha and pytorch_hstu_compute_output (concat_u,
    concat_x: cat([u, attn, u * LN(attn)]))."""
    h, dv, dqk = layer.heads, layer.linear_dim, layer.qk_dim
    normed = _ln(x, layer.input_norm_weight, layer.input_norm_bias, 1e-6)
    uvqk = normed @ layer.uvqk_weight + layer.uvqk_bias
    u, v, q, k = torch.split(uvqk, [h * dv, h * dv, h * dqk, h * dqk], dim=1)
    u = F.silu(u)
    attn = _ref_attention(
        q.reshape(-1, h, dqk), k.reshape(-1, h, dqk), v.reshape(-1, h, dv), lengths, num_targets, 1 / dqk**0.5
    ).reshape(-1, h * dv)
    y = u * _ln(attn, layer.output_norm_weight, layer.output_norm_bias, 1e-6)
    return x + torch.cat([u, attn, y], dim=1) @ layer.output_weight


def _ref_positions(s, nt, n_pad, ctx, buckets):
    """_get_col_indices (pt_position.py), one sample."""
    col = torch.arange(n_pad).view(1, n_pad)
    high = torch.tensor([s - nt])
    col = torch.clamp(col, max=high.view(-1, 1))
    col = high.view(-1, 1) - col + ctx
    col = torch.clamp(col, max=buckets - 1)
    col[:, :ctx] = torch.arange(0, ctx).view(1, -1)
    return col[0, :s]


def _ref_time_buckets(ts, n_time):
    """pytorch_add_timestamp_positional_embeddings's time part, one sample (ts int64 of its tokens)."""
    query = ts[-1:]
    d = (query - ts).clamp(min=1e-6) / 60.0
    d = torch.sqrt(d)
    return d.clamp(min=0).int().clamp(0, n_time).long()


def _ref_forward(model, samples, cfg=CFG):
    """DlrmHSTU.forward for the yambda config, sample by sample up to the STU stack (which needs the
    batch's longest sequence), then per-candidate heads. Returns logits [T_c] and the loss."""
    f, w = cfg.features, model.embedding.weight
    starts = dict(zip([n for n, _ in cfg.tables], model.embedding.starts, strict=True))
    pre, pos_enc, post = model.preprocessor, model.positional, model.postprocessor
    seqs, times, lengths, num_targets, cand_embs, labels, qts = [], [], [], [], [], [], []
    ctx_n = len(f.contextual)
    for uih, cand in samples:
        ctx_e = torch.stack([w[starts[name] + int(uih[name][0][0])] for name in f.contextual])
        merged = []  # per sequence feature: [n + c, E], the history then the candidates (concat_2D_jagged)
        for u, cn, table in f.sequence:
            rows = np.concatenate([uih[u][0], cand[cn][0]]) + starts[table]
            merged.append(w[torch.from_numpy(rows)])
        n, c = len(uih[f.action][0]), len(cand[f.candidate_action][0])
        out = _mlp(merged[0], pre.content_mlp)
        out = out + _mlp(torch.cat(merged[1:], dim=1), pre.additional_mlp)
        acts = torch.from_numpy(uih[f.action][0])
        bits = torch.stack([(acts & a) > 0 for a in cfg.action_weights], dim=1)  # [n, actions]
        act_emb = (bits.unsqueeze(-1) * pre.action_table.unsqueeze(0)).reshape(n, -1)
        act_emb = torch.cat([act_emb, pre.target_action_table.repeat(c, 1)])
        out = out + _mlp(act_emb, pre.action_mlp)
        ctx_out = torch.stack(
            [ctx_e[j] @ pre.contextual_weight[j] + pre.contextual_bias[j] for j in range(ctx_n)]
        )
        seqs.append(torch.cat([ctx_out, out]))
        ts = np.concatenate([np.zeros(ctx_n, dtype=np.int64), uih[f.timestamp][0], cand[f.query_time][0]])
        times.append(torch.from_numpy(ts))
        lengths.append(ctx_n + n + c)
        num_targets.append(c)
        cand_embs.append(torch.cat([m[n:] for m in merged], dim=1))
        labels.append(torch.from_numpy(cand[f.candidate_action][0]))
        qts.append(torch.from_numpy(cand[f.query_time][0]))
    n_pad = max(lengths)
    x = []
    for seq, ts, s, nt in zip(seqs, times, lengths, num_targets, strict=True):
        pos = _ref_positions(s, nt, n_pad, ctx_n, cfg.position_buckets)
        tb = _ref_time_buckets(ts, cfg.time_buckets)
        x.append(seq * cfg.dim**0.5 + (pos_enc.time[tb] + pos_enc.position[pos]))
    x = torch.cat(x)
    for layer in model.layers:
        x = _ref_stu(layer, x, lengths, num_targets)
    ends = np.cumsum(lengths)
    user = torch.cat([x[e - nt : e] for e, nt in zip(ends, num_targets, strict=True)])
    qt = torch.cat(qts)
    # TimestampLayerNormPostprocessor._concat_time_features
    feats = []
    for period, units in ((3600, 24), (86400, 7)):
        since = torch.div(qt.float(), float(period), rounding_mode="floor")
        ang = torch.remainder(since, float(units)) / float(units) * 2 * 3.14
        feats += [torch.cos(ang), torch.sin(ang)]
    user = torch.cat([user, torch.stack(feats, dim=1)], dim=1) @ post.combiner.weight.T + post.combiner.bias
    user = _ln(user, post.norm.weight, post.norm.bias, 1e-5)
    item = _mlp(torch.cat(cand_embs), model.item_mlp)
    logits = _mlp(user * item, model.head).squeeze(-1)
    y = ((torch.cat(labels) & cfg.task_bit) > 0).float()
    loss = F.binary_cross_entropy_with_logits(logits, y, reduction="none").sum() / max(len(y), 1) * 0.2
    return logits, loss


# ---- tests -----------------------------------------------------------------------------------------------


def _jagged_qkv(lengths, seed=0, h=2, a=6, v=8):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    return (
        torch.randn(t, h, a, generator=g),
        torch.randn(t, h, a, generator=g),
        torch.randn(t, h, v, generator=g),
    )


# block 0: one pair of matmuls over the padded batch; 3 and 5: query blocks (not dividing N), recomputed in
# the backward by hand (_BlockedAttention), so the gradients are checked too.
@pytest.mark.parametrize("block", [0, 3, 5])
def test_jagged_attention_matches_the_reference_loop(block):
    uih, cands, ctx = torch.tensor([4, 9, 1, 6]), torch.tensor([1, 3, 2, 4]), 2
    layout = SequenceLayout.build(uih, cands, ctx)
    lengths = (uih + cands + ctx).tolist()
    ours_in = [x.requires_grad_() for x in _jagged_qkv(lengths)]
    ref_in = [x.detach().clone().requires_grad_() for x in ours_in]
    ours = hstu_attention(*ours_in, layout, 0.4, block)
    ref = _ref_attention(*ref_in, lengths, cands.tolist(), 0.4)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn(ours.shape, generator=torch.Generator().manual_seed(9))
    ours.backward(g)
    ref.backward(g)
    for a, b in zip(ours_in, ref_in, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_candidates_attend_the_history_and_themselves_only():
    """Target-aware: a candidate's output does not change when another candidate's key or value does; a
    history token's output does not change when a later token's does (causal)."""
    uih, cands = torch.tensor([5]), torch.tensor([3])
    layout = SequenceLayout.build(uih, cands, 1)
    q, k, v = _jagged_qkv([9], seed=1)
    base = hstu_attention(q, k, v, layout, 0.5)
    k2, v2 = k.clone(), v.clone()
    k2[7] += 1.0  # the second candidate
    v2[7] += 1.0
    moved = hstu_attention(q, k2, v2, layout, 0.5)
    torch.testing.assert_close(moved[6], base[6])  # first candidate
    torch.testing.assert_close(moved[8], base[8])  # third candidate
    torch.testing.assert_close(moved[:6], base[:6])  # contextual + history: all before position 7
    assert not torch.allclose(moved[7], base[7])


@pytest.mark.parametrize("block", [0, 4])
def test_stu_stack_matches_the_reference(block):
    model = _model(1, dataclasses.replace(CFG, attention_block=block))
    uih, cands = torch.tensor([7, 2, 11]), torch.tensor([2, 1, 3])
    layout = SequenceLayout.build(uih, cands, CFG.contextual_len)
    lengths = layout.lengths.tolist()
    x = torch.randn(sum(lengths), CFG.dim, generator=torch.Generator().manual_seed(3))
    ours, ref = x, x
    for layer in model.layers:
        ours = layer(ours, layout)
        ref = _ref_stu(layer, ref, lengths, cands.tolist())
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_forward_and_backward_match_the_reference():
    ours = _model(2)
    ref = copy.deepcopy(ours)
    samples = _samples(4)
    batch = hstu.collate(samples, CFG.features)
    logits = ours(batch)
    loss = ours.loss(logits, batch)
    loss.backward()
    ref_logits, ref_loss = _ref_forward(ref, samples)
    ref_loss.backward()
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert ours.embedding.weight.grad.is_sparse  # row-sparse: the optimizer touches looked-up rows only
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        g = p.grad.to_dense() if p.grad.is_sparse else p.grad
        torch.testing.assert_close(g, q.grad, rtol=1e-5, atol=1e-6, msg=f"gradient of {name}")


def test_reference_flops_per_sample():
    """README.MD 'Computation cost analysis': 315.7 GFLOP per sample (attention 180.4, UVQK 77.3, output
    58.0) at S 4096, D 512, 4 heads of 128, 3 layers; the jagged count equals it at full length."""
    cfg = hstu.HSTUConfig()
    assert hstu.flops_per_sample(cfg) == pytest.approx(315.7e9, rel=2e-4)
    s, d, h, dh = 4096.0, 512, 4, 128
    attention = 3 * 3.5 * 2 * (s * s / 2) * h * (2 * dh)
    uvqk = 3 * 3 * 2 * s * d * h * 4 * dh
    out = 3 * 3 * 2 * s * 3 * h * dh * d
    assert (round(attention / 1e9, 1), round(uvqk / 1e9, 1), round(out / 1e9, 1)) == (180.4, 77.3, 58.0)
    assert hstu.flops_per_sample(cfg) == attention + uvqk + out + 6 * d  # + the task head Linear(D, 1)
    full = torch.full((8,), 4096)
    assert hstu.jagged_flops_per_sample(cfg, full) == pytest.approx(hstu.flops_per_sample(cfg))


def test_reference_shape_builds_on_the_meta_device():
    cfg = hstu.HSTUConfig()
    assert len(cfg.tables) == 11 and cfg.rows == 293_051_712
    with torch.device("meta"):
        model = hstu.FAMILY.build(cfg)
    assert model.embedding.weight.is_meta and tuple(model.embedding.weight.shape) == (293_051_712, 512)
    assert hstu.param_count(cfg) == sum(p.numel() for p in model.parameters())
    assert hstu.FAMILY.block_params(cfg) == sum(p.numel() for p in model.layers[0].parameters())
    tables = hstu.FAMILY.embedding_tables(cfg)
    assert tables.sizes == cfg.table_sizes and tables.dim == 512


def test_rowwise_adagrad_on_the_tables_equals_the_dense_formula():
    """Three steps of the dlrmv4 optimizers (row-wise Adagrad on the tables, Adam on the rest): the tables
    equal the dense row-wise formula applied to the full gradient; rows no batch looked up stay bitwise."""
    model = _model(5)
    start = model.embedding.weight.detach().clone()
    table_opt = SparseAdagrad(hstu.table_parameters(model), lr=0.05, eps=1e-8, rowwise=True)
    dense_opt = torch.optim.Adam(hstu.dense_parameters(model), lr=1e-3, betas=(0.95, 0.999), eps=1e-8)
    w, state, touched = (
        start.clone(),
        torch.zeros(start.shape[0]),
        torch.zeros(start.shape[0], dtype=torch.bool),
    )
    for step in range(3):
        batch = hstu.collate(_samples(10 + step))
        for opt in (table_opt, dense_opt):
            opt.zero_grad()
        model.loss(model(batch), batch).backward()
        g = model.embedding.weight.grad.to_dense()
        touched |= g.abs().sum(1) > 0
        table_opt.step()
        dense_opt.step()
        state += g.pow(2).mean(1)
        w = w - 0.05 * g / (state.sqrt() + 1e-8).unsqueeze(1)
        torch.testing.assert_close(model.embedding.weight.detach(), w, rtol=1e-6, atol=1e-7)
    assert 0 < int(touched.sum()) < start.shape[0]
    assert torch.equal(model.embedding.weight.detach()[~touched], start[~touched])


def test_collate_reads_the_reference_sample_layout():
    samples = _samples(7)
    batch = hstu.collate(samples)
    merged = hstu.collate([{**u, **c} for u, c in samples])  # one mapping per sample works the same
    assert torch.equal(batch.uih_ids, merged.uih_ids) and torch.equal(batch.query_times, merged.query_times)
    assert batch.uih_lengths.tolist() == [3, 9, 12, 5] and batch.num_candidates.tolist() == [1, 3, 2, 1]
    assert batch.contextual_ids.shape == (4, 8) and batch.uih_ids.shape == (29, 3)
    u, c = samples[1]
    assert batch.uih_ids[3:12, 1].tolist() == u["artist_id"][0].tolist()
    assert batch.candidate_ids[1:4, 0].tolist() == c["item_candidate_id"][0].tolist()
    assert batch.contextual_ids[1].tolist() == [int(u[n][0][0]) for n in CFG.features.contextual]
    bad = copy.deepcopy(samples)
    bad[0][0]["album_id"] = (bad[0][0]["album_id"][0][:-1], 3)
    with pytest.raises(ValueError, match="album_id"):
        hstu.collate(bad)


def test_tiny_model_learns_a_planted_label():
    """A sanity check that the pieces train together: the label is the candidate item's parity."""
    torch.manual_seed(0)
    model = _model(6)
    tables = SparseAdagrad(hstu.table_parameters(model), lr=0.1, rowwise=True)
    dense = torch.optim.Adam(hstu.dense_parameters(model), lr=3e-3)
    losses = []
    for step in range(25):
        samples = _samples(100 + step % 5, hist=(6,) * 8, cands=(1,) * 8)
        for _u, c in samples:
            c[CFG.features.candidate_action] = (c["item_candidate_id"][0] % 2, 1)
        batch = hstu.collate(samples)
        tables.zero_grad()
        dense.zero_grad()
        loss = model.loss(model(batch), batch)
        loss.backward()
        tables.step()
        dense.step()
        losses.append(loss.item())
    assert math.isfinite(losses[-1]) and np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5])


def test_meta_build_then_init_equals_an_eager_build():
    """The harness's path: build on the meta device, to_empty, init (buffers refilled too)."""
    with torch.device("meta"):
        meta = hstu.FAMILY.build(CFG)
    meta = meta.to_empty(device="cpu")
    hstu.FAMILY.init(meta, torch.Generator().manual_seed(3))
    eager = _model(3)
    batch = hstu.collate(_samples(8))
    torch.testing.assert_close(meta(batch), eager(batch), rtol=0, atol=0)


def test_init_draws_the_reference_distributions():
    """Tables U(+-sqrt(1/rows)); STU and item-MLP weights xavier-uniform; the preprocessor MLPs
    xavier-normal (HSTUTransducer re-draws them); contextual maps N(0, sqrt(2 / (in + out)))."""
    cfg = hstu.HSTUConfig(tables=hstu.tiny_tables(400, 100), table_dim=64, dim=64, linear_dim=32, qk_dim=32)
    model = _model(4, cfg)
    w = model.embedding.weight
    for t, rows in enumerate(cfg.table_sizes):
        part = w[model.embedding.table_rows(t)]
        assert part.abs().max() <= math.sqrt(1 / rows) and part.abs().max() > 0.9 * math.sqrt(1 / rows)
    uvqk = model.layers[0].uvqk_weight
    assert uvqk.abs().max() <= math.sqrt(6 / sum(uvqk.shape))
    lin = model.preprocessor.content_mlp[0].weight  # normal: past the uniform bound somewhere, std as drawn
    assert lin.abs().max() > math.sqrt(6 / sum(lin.shape))
    assert lin.std().item() == pytest.approx(math.sqrt(2 / sum(lin.shape)), rel=0.1)
    assert model.item_mlp[0].weight.abs().max() <= math.sqrt(6 / sum(model.item_mlp[0].weight.shape))
    ctx = model.preprocessor.contextual_weight
    assert ctx.std().item() == pytest.approx(math.sqrt(2 / (64 + 64)), rel=0.05)
    assert model.preprocessor.action_table.std().item() == pytest.approx(0.1, rel=0.6)
