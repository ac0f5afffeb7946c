"""Worker: deterministic collectives against the local balanced tree, bit for bit; or a bandwidth bench.

    python -m h3lab.run.workers.collective_check OUT_DIR [--configs all:gather_tree ...] [--shapes 7,33x17]
    python -m h3lab.run.workers.collective_check OUT_DIR --bench --device cuda --backend nccl --bench-mib 1,1024

Launched only through `h3lab.run.launch.launch`. Every rank regenerates every member's partial from
(seed, case, rank), so it computes the expected tree itself and nothing large is shipped back.
A config is RANKS:ALGORITHM[:LOCAL_SIZE], RANKS = "all" or comma-separated global ranks.
Writes OUT_DIR/rank{r}.json: verdicts per (config, shape), decision records, byte counts, timings.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from h3lab.dist.collectives import DeterministicCollective, new_collective
from h3lab.io.jsonfile import write_json
from h3lab.metrics import bitwise_equal, sha256_tensor
from h3lab.ops.fixed import balanced_tree

DEFAULT_SHAPES = "1,7,9973,65537,33x17,3x5"  # odd numels, 2-D, and fewer rows than members (empty chunks)


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


def check_shape(
    coll: DeterministicCollective, name: str, shape: tuple[int, ...], case: int, seed: int, device: torch.device
) -> dict:
    """All verdicts for one shape on one collective (this rank is a member)."""
    members, me = coll.members, coll.index
    P = len(members)
    verdicts: dict[str, bool] = {}
    for rep in range(2):  # fresh data at the same sites: stale frames or buffers would show
        parts = [partial(seed, case * 2 + rep, q, shape) for q in members]
        expected = balanced_tree(parts) if P > 1 else parts[0].clone()
        x = parts[me].to(device)
        got = coll.all_reduce(x, f"{name}/{shape}/all_reduce")
        verdicts[f"all_reduce.{rep}"] = bitwise_equal(got, expected)
        chunk = coll.reduce_scatter(x, f"{name}/{shape}/reduce_scatter")
        verdicts[f"reduce_scatter.{rep}"] = bitwise_equal(chunk, torch.tensor_split(expected, P, dim=0)[me])
        verdicts[f"reduce_scatter_is_all_reduce_slice.{rep}"] = bitwise_equal(
            chunk, torch.tensor_split(got, P, dim=0)[me]
        )
        verdicts[f"input_unchanged.{rep}"] = bitwise_equal(x, parts[me])
    # all_gather: member i contributes shape[0] + i rows (uneven), along dim 0 and along the last dim
    for dim in sorted({0, len(shape) - 1}):
        pieces = []
        for i, q in enumerate(members):
            grown = list(shape)
            grown[dim] += i
            pieces.append(partial(seed, case * 2 + 7, q, tuple(grown)))
        got = coll.all_gather(pieces[me].to(device), f"{name}/{shape}/all_gather.dim{dim}", dim=dim)
        verdicts[f"all_gather.dim{dim}"] = bitwise_equal(got, torch.cat(pieces, dim=dim))
    even = partial(seed, case * 2 + 9, members[me], shape)
    got = coll.all_gather(even.to(device), f"{name}/{shape}/all_gather.sizes", sizes=[shape[0]] * P)
    verdicts["all_gather.sizes_given"] = bitwise_equal(
        got, torch.cat([partial(seed, case * 2 + 9, q, shape) for q in members])
    )
    parts = [partial(seed, case * 2, q, shape) for q in members]
    # the checks can only catch a wrong order if the order matters: the right-leaning chain
    # r0+(r1+(...)) must give other bits (P=2 has one add, so it cannot)
    right_chain = parts[-1]
    for p in reversed(parts[:-1]):
        right_chain = p + right_chain
    order_sensitive = P >= 3 and not bitwise_equal(right_chain, balanced_tree(parts))
    return {"verdicts": verdicts, "order_sensitive": order_sensitive}


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
        created = time.perf_counter() - created
        if coll.index is None:
            errors[f"{config}/non_member"] = expect_value_error(lambda c=coll: c.all_reduce(torch.ones(3), "x"))
            coll.close()
            continue
        start = time.perf_counter()
        for si, shape in enumerate(shapes):
            row = check_shape(coll, config, shape, (ci * 100 + si) * 10, args.seed, device)
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


def run_bench(args: argparse.Namespace, device: torch.device) -> dict:
    """Median all_reduce time per (size, algorithm) against the backend's own all_reduce (SUM)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    colls = {
        alg: new_collective(list(range(world)), algorithm=alg, device=device) for alg in ("gather_tree", "scatter_tree")
    }
    for L in (int(v) for v in args.local_sizes.split(",") if v):
        colls[f"hierarchical:{L}"] = new_collective(
            list(range(world)), algorithm="hierarchical", local_size=L, device=device
        )
    rows = []
    for mib in (float(v) for v in args.bench_mib.split(",")):
        numel = max(1, int(mib * (1 << 20)) // 4)
        nbytes = numel * 4
        x = partial(args.seed, 0, rank, (numel,)).to(device)
        hashes = {}
        for name in [*colls, "backend_all_reduce"]:
            times = []
            for it in range(args.warmup + args.iters):
                dist.barrier()
                _sync(device)
                t0 = time.perf_counter()
                if name == "backend_all_reduce":
                    out = x.clone()
                    dist.all_reduce(out)
                else:
                    out = colls[name].all_reduce(x, f"bench/{mib}")
                _sync(device)
                if it >= args.warmup:
                    times.append(time.perf_counter() - t0)
                if it == 0:
                    hashes[name] = sha256_tensor(out.cpu())
            t = statistics.median(times)
            alg_bw = nbytes / t / 1e9  # nccl-tests conventions: busBw = algBw * 2(P-1)/P for all_reduce
            rows.append(
                {
                    "mib": mib,
                    "bytes": nbytes,
                    "name": name,
                    "median_s": t,
                    "min_s": min(times),
                    "alg_bw_gbs": alg_bw,
                    "bus_bw_gbs": alg_bw * 2 * (world - 1) / world,
                }
            )
        ours = {h for n, h in hashes.items() if n != "backend_all_reduce"}
        rows.append(
            {
                "mib": mib,
                "name": "bitwise",
                "ours_agree": len(ours) == 1,
                "backend_sum_equal_ours": hashes["backend_all_reduce"] in ours,
            }
        )
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
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="h3lab.run.workers.collective_check")
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
    args = parser.parse_args(argv)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend)
    try:
        record = run_bench(args, device) if args.bench else run_checks(args, device)
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(args.out / f"rank{dist.get_rank()}.json", record)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
