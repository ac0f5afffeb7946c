"""Worker: deterministic collectives against the local balanced tree, bit for bit; or a bandwidth bench.

    python -m h3lab.bench.workers.collective_check OUT_DIR [--configs all:gather_tree ...] [--shapes 7,33x17]
    python -m h3lab.bench.workers.collective_check OUT_DIR --bench --device cuda --backend nccl --bench-mib 1,1024 \
        [--local-sizes 2] [--segment-mib 32]

Launched only through `h3lab.launch.launcher.launch`. Every rank regenerates every member's partial from
(seed, case, rank), so it computes the expected tree itself and nothing large is shipped back.
A config is RANKS:ALGORITHM[:LOCAL_SIZE], RANKS = "all" or comma-separated global ranks.
Writes OUT_DIR/rank{r}.json: verdicts per (config, shape), decision records, byte counts, timings.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from h3lab.io.jsonfile import write_json
from h3lab.launch.lifeline import exit_now, watch
from h3lab.metrics import bitwise_equal
from h3lab.ops.fixed import balanced_tree, round_to
from h3lab.parallel.collective_groups import new_collective
from h3lab.parallel.collectives import DeterministicCollective

DEFAULT_SHAPES = "1,7,9973,65537,33x17,3x5"  # odd numels, 2-D, and fewer rows than members (empty chunks)
# scatter_tree configs are checked pipelined too, with segments this small: 9973 and 65537 FP32
# elements give 3 and 17 segments, the last one short (padded)
CHECK_SEGMENT_BYTES = 16 << 10


def partial(seed: int, case: int, rank: int, shape: tuple[int, ...]) -> Tensor:
    """Rank `rank`'s FP32 partial for `case`: normals scaled by 2^[-12, 12), so the add order shows in the bits."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + case) * 4099 + rank)
    scale = torch.exp2(torch.randint(-12, 12, shape, generator=g).to(torch.float32))
    return torch.randn(shape, generator=g) * scale


def parse_config(text: str, world: int) -> tuple[list[int], str, int | None]:
    parts = text.split(":")
    ranks = list(range(world)) if parts[0] == "all" else [int(r) for r in parts[0].split(",")]
    algorithm = parts[1] if len(parts) > 1 else "auto"
    local_size = int(parts[2]) if len(parts) > 2 else None
    return ranks, algorithm, local_size


def parse_shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split("x"))


def _to_bf16(t: Tensor) -> Tensor:
    return round_to(t, torch.bfloat16)


def check_shape(
    coll: DeterministicCollective,
    name: str,
    shape: tuple[int, ...],
    case: int,
    seed: int,
    device: torch.device,
    segmented: DeterministicCollective | None = None,
) -> dict:
    """All verdicts for one shape on one collective (this rank is a member); `segmented`: the same
    collective with pipelined segments, checked against the same tree."""
    members, me = coll.members, coll.index
    site = f"{name}/{shape}"
    verdicts: dict[str, bool] = {}
    for rep in range(2):  # fresh data at the same sites: stale frames or buffers would show
        parts = [partial(seed, case * 2 + rep, q, shape) for q in members]
        expected = balanced_tree(parts) if len(members) > 1 else parts[0].clone()
        x = parts[me].to(device)
        verdicts |= _reduce_verdicts(coll, site, x, parts[me], expected, rep)
        # finished before sharing (the block's rounding to bf16): every path gives round(tree)
        rounded = round_to(expected, torch.bfloat16)
        verdicts |= _rounded_verdicts(coll, site, x, rounded, rep)
        if segmented is not None:
            verdicts |= _segmented_verdicts(segmented, site, x, expected, rounded, rep)
    verdicts |= _gather_verdicts(coll, site, shape, case, seed, device)
    return {"verdicts": verdicts, "order_sensitive": _order_sensitive(members, shape, case, seed)}


def _my_chunk(t: Tensor, coll: DeterministicCollective) -> Tensor:
    """This member's row chunk of `t`, as reduce_scatter splits it (torch.tensor_split along dim 0)."""
    return torch.tensor_split(t, len(coll.members), dim=0)[coll.index]


def _reduce_verdicts(
    coll: DeterministicCollective, site: str, x: Tensor, mine: Tensor, expected: Tensor, rep: int
) -> dict[str, bool]:
    """all_reduce, reduce_scatter and their started forms give the tree's bits; `x` (== `mine`) is kept."""
    verdicts: dict[str, bool] = {}
    got = coll.all_reduce(x, f"{site}/all_reduce")
    verdicts[f"all_reduce.{rep}"] = bitwise_equal(got, expected)
    chunk = coll.reduce_scatter(x, f"{site}/reduce_scatter")
    verdicts[f"reduce_scatter.{rep}"] = bitwise_equal(chunk, _my_chunk(expected, coll))
    verdicts[f"reduce_scatter_is_all_reduce_slice.{rep}"] = bitwise_equal(chunk, _my_chunk(got, coll))
    verdicts[f"input_unchanged.{rep}"] = bitwise_equal(x, mine)
    started = coll.start_all_reduce(x, f"{site}/start_all_reduce")
    verdicts[f"start_all_reduce.{rep}"] = bitwise_equal(started(), expected)
    started = coll.start_reduce_scatter(x, f"{site}/start_reduce_scatter")
    verdicts[f"start_reduce_scatter.{rep}"] = bitwise_equal(started(), _my_chunk(expected, coll))
    return verdicts


def _rounded_verdicts(
    coll: DeterministicCollective, site: str, x: Tensor, rounded: Tensor, rep: int
) -> dict[str, bool]:
    """Each reduction finished by `then` (bf16 rounding) before sharing gives `rounded`, round(tree)."""
    verdicts: dict[str, bool] = {}
    got = coll.all_reduce(x, f"{site}/then_all_reduce", then=_to_bf16)
    verdicts[f"then_all_reduce.{rep}"] = bitwise_equal(got, rounded)
    got = coll.reduce_scatter(x, f"{site}/then_reduce_scatter", then=_to_bf16)
    verdicts[f"then_reduce_scatter.{rep}"] = bitwise_equal(got, _my_chunk(rounded, coll))
    started = coll.start_all_reduce(x, f"{site}/then_start_all_reduce", then=_to_bf16)
    verdicts[f"then_start_all_reduce.{rep}"] = bitwise_equal(started(), rounded)
    return verdicts


def _segmented_verdicts(
    segmented: DeterministicCollective, site: str, x: Tensor, expected: Tensor, rounded: Tensor, rep: int
) -> dict[str, bool]:
    """The pipelined all_reduce gives the same tree's bits, plain and finished by bf16 rounding."""
    verdicts: dict[str, bool] = {}
    got = segmented.all_reduce(x, f"{site}/segmented")
    verdicts[f"segmented_all_reduce.{rep}"] = bitwise_equal(got, expected)
    got = segmented.all_reduce(x, f"{site}/then_segmented", then=_to_bf16)
    verdicts[f"then_segmented_all_reduce.{rep}"] = bitwise_equal(got, rounded)
    return verdicts


def _gather_verdicts(
    coll: DeterministicCollective, site: str, shape: tuple[int, ...], case: int, seed: int, device: torch.device
) -> dict[str, bool]:
    """all_gather concatenates the members' pieces in member order, uneven or with their sizes given."""
    members, me = coll.members, coll.index
    verdicts: dict[str, bool] = {}
    # member i contributes shape[0] + i rows (uneven), along dim 0 and along the last dim
    for dim in sorted({0, len(shape) - 1}):
        pieces = []
        for i, q in enumerate(members):
            grown = list(shape)
            grown[dim] += i
            pieces.append(partial(seed, case * 2 + 7, q, tuple(grown)))
        got = coll.all_gather(pieces[me].to(device), f"{site}/all_gather.dim{dim}", dim=dim)
        verdicts[f"all_gather.dim{dim}"] = bitwise_equal(got, torch.cat(pieces, dim=dim))
    even = partial(seed, case * 2 + 9, members[me], shape)
    got = coll.all_gather(even.to(device), f"{site}/all_gather.sizes", sizes=[shape[0]] * len(members))
    verdicts["all_gather.sizes_given"] = bitwise_equal(
        got, torch.cat([partial(seed, case * 2 + 9, q, shape) for q in members])
    )
    return verdicts


def _order_sensitive(members: list[int], shape: tuple[int, ...], case: int, seed: int) -> bool:
    """Whether the checks can catch a wrong order at all: only if the right-leaning chain r0+(r1+(...))
    gives other bits than the tree (P=2 has one add, so it cannot)."""
    parts = [partial(seed, case * 2, q, shape) for q in members]
    right_chain = parts[-1]
    for p in reversed(parts[:-1]):
        right_chain = p + right_chain
    return len(members) >= 3 and not bitwise_equal(right_chain, balanced_tree(parts))


def expect_value_error(fn) -> str | None:
    """The ValueError message `fn` raises, or None when it raises nothing."""
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


def run_checks(args: argparse.Namespace, device: torch.device) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    configs = args.configs or default_configs(world, args.local_sizes, args.subgroups)
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    results, decisions, errors = [], {}, {}
    for ci, config in enumerate(configs):
        ranks, algorithm, local_size = parse_config(config, world)
        created = time.perf_counter()
        coll = new_collective(ranks, algorithm=algorithm, local_size=local_size, device=device)
        segmented = None
        if algorithm == "scatter_tree":
            segmented = new_collective(ranks, algorithm=algorithm, device=device, segment_bytes=CHECK_SEGMENT_BYTES)
        created = time.perf_counter() - created
        if coll.index is None:
            errors[f"{config}/non_member"] = expect_value_error(lambda c=coll: c.all_reduce(torch.ones(3), "x"))
            coll.close()
            continue
        seg_sites = segmented.decisions if segmented is not None else list
        start = time.perf_counter()
        for si, shape in enumerate(shapes):
            row = check_shape(coll, config, shape, (ci * 100 + si) * 10, args.seed, device, segmented)
            row.update(
                config=config,
                ranks=ranks,
                algorithm=algorithm,
                local_size=local_size,
                P=len(ranks),
                member=coll.index,
                shape=list(shape),
                numel=int(torch.Size(shape).numel()),
            )
            results.append(row)
        if len(ranks) > 1:  # mismatched shapes: every member must raise, none may hang
            bad = torch.ones(4 + (coll.index == 0), device=device)
            errors[f"{config}/shape_mismatch"] = expect_value_error(lambda c=coll, b=bad: c.all_reduce(b, "bad"))
            bad2 = torch.ones(2, 3 + (coll.index == 0), device=device)
            errors[f"{config}/gather_mismatch"] = expect_value_error(
                lambda c=coll, b=bad2: c.all_gather(b, "bad_gather", dim=0)
            )
        token = coll.shared_memory_token  # frames are unlinked once mapped: no name may remain
        leftovers = len(list(Path("/dev/shm").glob(f"h3lab-{token}-*"))) if token else 0
        decisions[config] = {
            "decisions": coll.decisions(),
            "seconds": time.perf_counter() - start,
            "create_seconds": created,
            "shm_token": token,
            "shm_leftovers": leftovers,
            "segmented_decisions": seg_sites(),
        }
        coll.close()
        errors[f"{config}/closed"] = expect_value_error(lambda c=coll: c.all_reduce(torch.ones(3), "x"))
    return {"rank": rank, "world": world, "results": results, "decisions": decisions, "errors": errors}


def default_configs(world: int, local_sizes: str, subgroups: str) -> list[str]:
    configs = [f"all:{alg}" for alg in ("gather_tree", "scatter_tree", "auto")]
    configs += [f"all:hierarchical:{L}" for L in local_sizes.split(",") if L]
    configs += [f"{ranks}:{alg}" for ranks in subgroups.split(";") if ranks for alg in ("gather_tree", "scatter_tree")]
    return configs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_partial(seed: int, rank: int, numel: int, device: torch.device) -> Tensor:
    """`partial`'s distribution drawn on `device` (its generator): every rank draws every member's
    partial of a GiB-size message in milliseconds, so each checks the tree itself."""
    g = torch.Generator(device).manual_seed(seed * 4099 + rank)
    scale = torch.exp2(torch.randint(-12, 12, (numel,), generator=g, device=device).to(torch.float32))
    return torch.randn(numel, generator=g, device=device) * scale


def _timed_ms(fn, device: torch.device) -> tuple[float, Tensor]:
    """(milliseconds, result) of one call after a barrier and a device synchronisation: CUDA events
    on the current stream (the collective's wait included), wall clock on CPU."""
    dist.barrier()
    _sync(device)
    if device.type != "cuda":
        t = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t) * 1e3, out
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end), out


def bench_collectives(args: argparse.Namespace, world: int, device: torch.device) -> dict:
    """Ours (per algorithm) and the backend's own sum for all_reduce and reduce_scatter."""
    ours = {
        alg: new_collective(list(range(world)), algorithm=alg, device=device) for alg in ("gather_tree", "scatter_tree")
    }
    if args.segment_mib:
        seg = int(float(args.segment_mib) * (1 << 20))
        ours[f"scatter_tree/seg{args.segment_mib}MiB"] = new_collective(
            list(range(world)), algorithm="scatter_tree", device=device, segment_bytes=seg
        )
    for L in (int(v) for v in args.local_sizes.split(",") if v):
        ours[f"hierarchical:{L}"] = new_collective(
            list(range(world)), algorithm="hierarchical", local_size=L, device=device
        )
    return ours


def run_bench(args: argparse.Namespace, device: torch.device) -> dict:
    """Median time per (op, size, algorithm) against the backend's all_reduce / reduce_scatter (SUM),
    each of ours checked bit for bit against the local balanced tree of every member's partial."""
    rank, world = dist.get_rank(), dist.get_world_size()
    colls = bench_collectives(args, world, device)
    rows = []
    for mib in (float(v) for v in args.bench_mib.split(",")):
        numel = max(world, int(mib * (1 << 20)) // 4 // world * world)  # even chunks for the backend's reduce_scatter
        nbytes = numel * 4
        parts = [bench_partial(args.seed, q, numel, device) for q in range(world)]
        expected = balanced_tree(parts)
        x = parts[rank]
        del parts
        for op in ("all_reduce", "reduce_scatter"):
            want = expected if op == "all_reduce" else torch.tensor_split(expected, world)[rank]
            for name in [*colls, "backend"]:
                row = _bench_one(args, colls, name, op, x, want, world, device)
                rows.append(row | {"mib": mib, "bytes": nbytes, "op": op, "name": name})
        del expected, x
    decisions = {name: c.decisions() for name, c in colls.items()}
    for c in colls.values():
        c.close()
    return {
        "rank": rank,
        "world": world,
        "device": str(device),
        "backend": dist.get_backend(),
        "bench": rows,
        "decisions": decisions,
        "iters": args.iters,
        "warmup": args.warmup,
        "timing": "CUDA events after a barrier and a device synchronisation" if device.type == "cuda" else "wall",
    }


def _bench_one(args, colls: dict, name: str, op: str, x: Tensor, want: Tensor, world: int, device) -> dict:
    def call() -> Tensor:
        if name != "backend":
            coll = colls[name]
            return coll.all_reduce(x, f"bench/{op}") if op == "all_reduce" else coll.reduce_scatter(x, f"bench/{op}")
        if op == "all_reduce":
            out = x.clone()
            dist.all_reduce(out)
            return out
        out = x.new_empty(x.numel() // world)
        dist.reduce_scatter_tensor(out, x)
        return out

    times, equal = [], None
    for it in range(args.warmup + args.iters):
        ms, out = _timed_ms(call, device)
        if it == 0:
            equal = bitwise_equal(out, want)
        if it >= args.warmup:
            times.append(ms)
        del out
    t = statistics.median(times) / 1e3
    alg_bw = x.numel() * 4 / t / 1e9  # nccl-tests: S = the input bytes per rank for both ops
    factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
    return {
        "median_s": t,
        "min_s": min(times) / 1e3,
        "max_s": max(times) / 1e3,
        "alg_bw_gbs": alg_bw,
        "bus_bw_gbs": alg_bw * factor,
        "bitwise_equal_tree": equal,
    }


def main(argv: list[str]) -> int:
    watch(exit_now(), parent_signal=signal.SIGKILL)  # no orphan when the agent or runner is gone
    parser = argparse.ArgumentParser(prog="h3lab.bench.workers.collective_check")
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", nargs="*", default=None, help="RANKS:ALGORITHM[:LOCAL_SIZE]; default: all")
    parser.add_argument("--local-sizes", default="", help="comma-separated local sizes for hierarchical configs")
    parser.add_argument("--subgroups", default="", help="';'-separated rank lists, e.g. '0,3,6;2,5'")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated, 2-D as RxC")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--bench-mib", default="0.0625,0.25,1,4", help="partial sizes in MiB (FP32)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--segment-mib", default="", help="--bench: also scatter_tree pipelined in segments of this")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, device_id=device if args.backend == "nccl" else None)
    try:
        record = run_bench(args, device) if args.bench else run_checks(args, device)
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(args.out / f"rank{dist.get_rank()}.json", record)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
