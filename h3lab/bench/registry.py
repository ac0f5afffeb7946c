"""The benchmarks a published report runs, as data: name -> module, arguments per node kind, output, needs.

`h3lab publish --node NODE` runs every benchmark that has arguments for the node: `python -m MODULE
ARGS --out FILE` (a folder for those that write several files, `record_in` naming the record in it).
Arguments are keyed by node type ("h200") or kind ("gpu" for every GPU node, "cpu"); a benchmark
with no key for the node does not run there. "{gpus}" and "{layouts}" in the arguments become the
GPUs the publish uses and the layouts whose world fits them. A benchmark that needs CUDA is skipped
on a CPU node with that reason, and one that needs more GPUs than the publish has is skipped saying
so: never faked, never run on something else.

Each record's table in the report is `h3lab.workbench.benchmarks.TABLES[name]`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from h3lab.parallel.layout import Layout

TRAIN_STEP_GPU = ("--rows", "4096", "--steps", "5", "--warmup", "2", "--device", "cuda", "--backend", "triton")
NODE_TYPES = ("cpu", "h100", "h200", "b200")  # h3lab.io.env.node_type, lower case
# the layouts the layout benchmark times, those whose world fits the publish's GPUs
LAYOUT_CANDIDATES = ("tp1", "tp2", "tp2+sp", "cp2", "tp4", "tp4xcp2+sp", "tp8", "tp8:2x4")


@dataclass(frozen=True)
class Benchmark:
    name: str  # the stage's name, and the table's key
    module: str  # python -m MODULE
    output: str  # the record's file name in the published folder
    what: str  # one line for the report and the folder's README
    args: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # node type or kind -> argv (no --out)
    needs_cuda: bool = False
    min_gpus: int = 0  # on GPU nodes: the GPUs it needs (one process per GPU)
    record_in: str | None = None  # the benchmark writes a folder: the record is this file in it
    timeout_s: float = 900.0  # the most one run may take on its node before it is stopped


@dataclass(frozen=True)
class Planned:
    """A benchmark resolved for one publish: its argv (None when skipped) and why it is skipped."""

    bench: Benchmark
    argv: list[str] | None
    skipped: str | None = None


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        "block_cpu",
        "h3lab.bench.block_cpu",
        "block-cpu.json",
        "the canonical block, forward + dX + every dW, tiny config, 264 rows, on CPU",
        {"cpu": ("--config", "tiny", "--rows", "264", "--repeats", "10")},
    ),
    Benchmark(
        "block",
        "h3lab.bench.block_gpu",
        "block.json",
        "the canonical block against the eager block (cuBLAS + SDPA), real shapes, captured and not",
        {"gpu": ("--rows", "264,4096", "--reps", "50")},
        needs_cuda=True,
    ),
    Benchmark(
        "block_long",
        "h3lab.bench.block_gpu",
        "block-long.json",
        "the same at long sequences, not captured",
        {"gpu": ("--rows", "16384,32768,65536", "--reps", "10", "--no-graphs")},
        needs_cuda=True,
    ),
    Benchmark(
        "gemm",
        "h3lab.bench.gemm_bench",
        "gemm.json",
        "the pinned fixed-order and unit-tree GEMMs against cuBLAS, real shapes",
        {"gpu": ("--candidates", "pinned")},
        needs_cuda=True,
    ),
    Benchmark(
        "chain",
        "h3lab.bench.chain_bench",
        "chain.json",
        "the float32 modules' chain GEMM over its tiles at the training step's shapes, cuBLAS FP32 beside",
        {"gpu": ("--candidates", "all")},
        needs_cuda=True,
    ),
    Benchmark(
        "attention",
        "h3lab.bench.attention_bench",
        "attention.json",
        "the attention kernels against SDPA, 264 and 4096 rows, TP1 and TP8 heads",
        {"gpu": ()},
        needs_cuda=True,
    ),
    Benchmark(
        "attention_long",
        "h3lab.bench.attention_long",
        "attention-long.json",
        "the pinned attention at 4096-65536 rows against the fastest SDPA backend",
        {"gpu": ("--rows", "4096,16384,32768,65536", "--variants", "pinned")},
        needs_cuda=True,
    ),
    Benchmark(
        "attention_fused",
        "h3lab.bench.attention_fused_bwd",
        "attention-fused-bwd.json",
        "the split attention backward against a fused one with dq added in key-block order",
        {"gpu": ("--rows", "16384,32768", "--repeats", "200")},
        needs_cuda=True,
    ),
    Benchmark(
        "profile",
        "h3lab.bench.block_profile",
        "profile.json",
        "where the block's time goes: kernels, launches, the GPU's idle time; kernel time by role against eager",
        {"gpu": ("--rows", "264,4096,32768", "--eager")},
        needs_cuda=True,
        record_in="profile.json",
    ),
    Benchmark(
        "layouts",
        "h3lab.bench.layouts",
        "layouts.json",
        "the layouts that fit the node: the deterministic step against eager at the same layout",
        {
            "cpu": ("--config", "tiny", "--device", "cpu", "--layouts", "tp1,tp2", "--rows", "264", "--steps", "5"),
            "gpu": ("--layouts", "{layouts}", "--rows", "4096,16384", "--steps", "20"),
        },
        timeout_s=1800.0,
    ),
    Benchmark(
        "train_step",
        "h3lab.bench.train_step",
        "train-step.json",
        "one training step of the depth with embedders, refiner and heads against diffusers + autograd + AdamW",
        {
            "cpu": ("--config", "tiny", "--device", "cpu", "--blocks", "0-1", "--rows", "96", "--steps", "3"),
            "gpu": ("--config", "real", "--blocks", "0-3", *TRAIN_STEP_GPU),
        },
    ),
    Benchmark(
        "train_step_depth",
        "h3lab.bench.train_step",
        "train-step-depth.json",
        "the training step at the deepest depth one GPU holds for both sides, where the blocks' ratio dominates",
        # the deepest depth both sides fit: the eager side holds 20 bytes a parameter (bf16 weight and grad,
        # FP32 master, grad and moments), which at 10 blocks outgrows an H200 (reports/h200/README.md)
        {"h200": ("--config", "real", "--blocks", "0-8", *TRAIN_STEP_GPU)},
        needs_cuda=True,
        timeout_s=1800.0,
    ),
    Benchmark(
        "train_profile",
        "h3lab.bench.train_profile",
        "train-profile.json",
        "the training step's GPU time, launches and host time by part (embed, stack, heads, their "
        "backwards, clip, update) against the eager step's, under torch.profiler",
        {"gpu": ("--config", "real", "--blocks", "0-3", "--rows", "4096", "--device", "cuda", "--backend", "triton")},
        needs_cuda=True,
    ),
    Benchmark(
        "parallelize_step",
        "h3lab.bench.parallelize_step",
        "parallelize-step.json",
        "your own training step through h3lab.parallelize (autograd, h3lab.optim) against h3lab's Trainer and "
        "diffusers + autograd + AdamW, real shapes, 4 blocks; bitwise under tp1 and tp2",
        {"h200": ("--config", "real", "--layers", "4", "--rows", "4096", "--steps", "5", "--device", "cuda")},
        needs_cuda=True,
        timeout_s=1800.0,
    ),
    Benchmark(
        "collectives",
        "h3lab.bench.collectives",
        "collectives.json",
        "the deterministic collectives' bus bandwidth against the backend's own sums",
        {
            "cpu": ("--ranks", "2", "--device", "cpu", "--mib", "1,4", "--iters", "5"),
            "gpu": ("--ranks", "{gpus}", "--device", "cuda"),
        },
        min_gpus=2,
    ),
)


def by_name(name: str) -> Benchmark:
    """The registered benchmark `name`; ValueError naming the allowed names otherwise."""
    for b in BENCHMARKS:
        if b.name == name:
            return b
    raise ValueError(f"unknown benchmark {name!r}; allowed: {[b.name for b in BENCHMARKS]}")


def fitting_layouts(gpus: int) -> list[str]:
    """The LAYOUT_CANDIDATES whose world fits `gpus` processes (tp1 on one GPU)."""
    return [name for name in LAYOUT_CANDIDATES if Layout.parse(name).world <= max(gpus, 1)]


def plan(node: str, gpus: int) -> list[Planned]:
    """Every registered benchmark for a publish on `node` with `gpus` GPUs: its argv, or why it is skipped.

    Raises:
        ValueError: an unknown node type, or GPUs on a CPU node.
    """
    if node not in NODE_TYPES:
        raise ValueError(f"node {node!r}; allowed: {list(NODE_TYPES)}")
    if node == "cpu" and gpus:
        raise ValueError(f"gpus={gpus} on a cpu node; allowed: 0")
    kind = "cpu" if node == "cpu" else "gpu"
    out = []
    for b in BENCHMARKS:
        args = b.args.get(node, b.args.get(kind))
        if b.needs_cuda and node == "cpu":
            out.append(Planned(b, None, "needs CUDA; this is a CPU node"))
        elif args is None:
            out.append(Planned(b, None, f"not run on {kind} nodes"))
        elif kind == "gpu" and gpus < b.min_gpus:
            out.append(Planned(b, None, f"needs {b.min_gpus} GPUs, one process per GPU; this publish has {gpus}"))
        else:
            fill = {"gpus": str(gpus), "layouts": ",".join(fitting_layouts(gpus))}
            out.append(Planned(b, ["-m", b.module, *(a.format(**fill) for a in args)]))
    return out
