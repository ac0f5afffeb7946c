"""The eager TP reference block (the layout benchmark's timings compare against it) computes the unsharded block.

Its sums run in another order than the unsharded block's, in bf16, so it is compared with a
tolerance: relative L2 below 2e-2, ~4x the bf16 eager block's own error against FP64 at these
sizes (`h3lab accuracy --config real` measures it at the real shapes); a wrong shard (swapped
hidden/gate, a missing all-reduce) gives errors of order 1.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from h3lab.batch import packed_batch
from h3lab.config import H3Config
from h3lab.launch.launcher import launch
from h3lab.metrics import error_stats
from h3lab.reference.eager import eager_block, tp_shard
from h3lab.reference.oracle import rope_cos_sin
from h3lab.weights import synthetic_block

TOL = 2e-2


def test_eager_tp2_over_gloo_is_the_unsharded_block(tmp_path):
    c = H3Config.tiny()
    res = launch(
        "h3lab.bench.workers.eager_tp",
        [str(tmp_path), "--config", "tiny", "--rows", "37", "--reps", "1", "--save"],
        nproc_per_node=2,
        log_dir=tmp_path / "logs",
        timeout_s=120,
    )
    assert res.ok, "\n".join(p.read_text()[-3000:] for p in res.agent_logs)
    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2)]
    assert json.loads((tmp_path / "rank1.json").read_text())["rows"]["37"]["fwd_bwd_median_s"] > 0

    w = synthetic_block(c, 0, seed=0)
    b = packed_batch(c, 37, seed=1)
    cos, sin = (t.to(torch.bfloat16) for t in rope_cos_sin(b.position_ids, c))
    ref = eager_block(w, b, cos, sin, True)
    shards = [tp_shard(w, r, 2) for r in range(2)]
    assert torch.equal(torch.cat([s["attn.to_q.weight"] for s in shards]), w["attn.to_q.weight"])

    def close(name: str, got: torch.Tensor) -> None:
        rel = error_stats(got, ref[name].double())["rel_l2"]
        assert rel < TOL, f"{name}: rel L2 {rel:.2e} >= {TOL}"

    for name in ("out", "dx", "dtemb", "dw.norm1.weight", "dw.attn.norm_q.weight", "dw.adaln_proj.linear.weight"):
        for r in range(2):  # replicated: every rank holds the whole tensor
            close(name, ranks[r][name])
    close("dw.attn.to_q.weight", torch.cat([ranks[r]["dw.attn.to_q.weight"] for r in range(2)]))
    close("dw.ff.net.2.weight", torch.cat([ranks[r]["dw.ff.net.2.weight"] for r in range(2)], dim=1))
    halves = [ranks[r]["dw.ff.net.0.proj.weight"].chunk(2) for r in range(2)]  # [hidden_r; gate_r] per rank
    close("dw.ff.net.0.proj.weight", torch.cat([halves[0][0], halves[1][0], halves[0][1], halves[1][1]]))


def test_eager_sp_and_cp_over_gloo_are_the_unsharded_block(tmp_path):
    """tp2+sp (rows split over the TP ranks between the TP regions) and cp2 (rows split, K/V
    all-gathered): each rank's rows of out and dx, and the gradients every rank holds whole after its
    bucketed reductions, match the unsharded block within TOL."""
    c, rows = H3Config.tiny(), 32
    res = launch(
        "h3lab.bench.workers.eager_tp",
        [str(tmp_path), "--config", "tiny", "--rows", str(rows), "--reps", "1", "--save", "--layouts", "tp2+sp,cp2"],
        nproc_per_node=2,
        log_dir=tmp_path / "logs",
        timeout_s=120,
    )
    assert res.ok, "\n".join(p.read_text()[-3000:] for p in res.agent_logs)
    w = synthetic_block(c, 0, seed=0)
    b = packed_batch(c, rows, seed=1)
    cos, sin = (t.to(torch.bfloat16) for t in rope_cos_sin(b.position_ids, c))
    ref = eager_block(w, b, cos, sin, True)

    def close(name: str, got: torch.Tensor) -> None:
        rel = error_stats(got, ref[name].double())["rel_l2"]
        assert rel < TOL, f"{name}: rel L2 {rel:.2e} >= {TOL}"

    for layout in ("tp2_sp", "cp2"):
        ranks = [load_file(str(tmp_path / f"rank{r}.{layout}.safetensors")) for r in range(2)]
        for name in ("out", "dx"):  # rank r holds rows [r*16, (r+1)*16)
            assert ranks[0][name].shape[0] == rows // 2
            close(name, torch.cat([ranks[r][name] for r in range(2)]))
        for name in (
            "dtemb",
            "dw.norm1.weight",
            "dw.norm2.weight",
            "dw.attn.norm_k.weight",
            "dw.adaln_proj.linear.bias",
        ):
            for r in range(2):
                close(name, ranks[r][name])
        if layout == "cp2":  # every rank holds every weight gradient whole
            for r in range(2):
                close("dw.attn.to_q.weight", ranks[r]["dw.attn.to_q.weight"])
                close("dw.ff.net.0.proj.weight", ranks[r]["dw.ff.net.0.proj.weight"])
        else:
            close("dw.attn.to_v.weight", torch.cat([ranks[r]["dw.attn.to_v.weight"] for r in range(2)]))
            close("dw.ff.net.2.weight", torch.cat([ranks[r]["dw.ff.net.2.weight"] for r in range(2)], dim=1))
