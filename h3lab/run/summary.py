"""A run's summary as text: one line per layout, and one line per failed or mismatched layout."""

from __future__ import annotations


def format_summary(summary: dict) -> str:
    """One line per layout: verdict, tensors equal, slowest rank's forward/backward, collective time; a
    training run adds a line per step under each layout (tensors equal per kind) and the canonical
    process's loss, norm and clip coefficient per step."""
    lines = [f"{'layout':<14} {'status':<9} {'equal':>7}  {'fwd s':>7} {'bwd s':>7} {'coll s':>7}"]
    for name, rec in summary["layouts"].items():
        tensors = rec.get("tensors", {})
        equal = f"{sum(t['bitwise_equal'] for t in tensors.values())}/{len(tensors)}" if tensors else "-"
        fwd, bwd, coll = (_slowest(rec.get("ranks", []), k) for k in ("forward_s", "backward_s", "collective_s"))
        lines.append(f"{name:<14} {rec['status']:<9} {equal:>7}  {fwd:7.3f} {bwd:7.3f} {coll:7.3f}")
        lines += [_step_line(k, v) for k, v in rec.get("steps", {}).items()]
    canonical = summary.get("canonical") or {}
    lines += [_values_line(k, v) for k, v in canonical.get("steps", {}).items()]
    if canonical.get("status") == "failed":
        f = canonical["failure"]
        lines.append(f"canonical: FAILED: {f['reason']}" + (f" (log: {f['log']})" if f.get("log") else ""))
    nonfinite = canonical.get("nonfinite") or {}
    if nonfinite:  # equal bits of NaN or Inf say nothing about the values: never a silent pass
        counts = ", ".join(f"{k} ({n})" for k, n in nonfinite.items())
        lines.append(
            f"WARNING: the canonical result holds NaN or Inf in {counts}; bitwise equality there is of bits only"
        )
    lines.append(f"overall: {summary['status']}" + (f" ({summary['error']})" if summary.get("error") else ""))
    return "\n".join(lines)


def _step_line(step: str, verdict: dict) -> str:
    """`  step 1    passed    loss 3/3, clip 2/2, gradients 86/86, weights 86/86` (a training run's layout)."""
    kinds = ", ".join(f"{kind} {v['equal']}/{v['total']}" for kind, v in verdict.items() if kind != "bitwise_equal")
    return f"  step {step:<4} {'passed' if verdict['bitwise_equal'] else 'mismatch':<9} {kinds}"


def _values_line(step: str, values: dict[str, float]) -> str:
    """`canonical step 1: loss 5.98053, loss.video 3.37957, loss.audio 2.60096, grad_norm 10.7216, clip_coef ...`."""
    parts = ", ".join(f"{k} {v:.6g}" for k, v in values.items())
    return f"canonical step {step}: {parts}"


def _slowest(ranks: list[dict], key: str) -> float:
    return max((r["timings"].get(key, float("nan")) for r in ranks), default=float("nan"))


def failure_line(layout: str, record: dict, context: str = "") -> str | None:
    """`layout (context): FAILED on rank R: reason (log: path)` or `...: MISMATCH in tensors`; None if it passed.

    `context` names the sweep cell (mode, batch seed) when a layout runs more than once."""
    where = f"{layout} ({context})" if context else layout
    if record["status"] == "failed":
        f = record["failure"]
        who = f"rank {f['rank']}" if f.get("rank") is not None else f"agent {f.get('agent', 0)}"
        return f"{where}: FAILED on {who}: {f['reason']} (log: {f['log']})"
    if record["status"] == "mismatch":
        bad = [k for k, t in record.get("tensors", {}).items() if not t["bitwise_equal"]]
        return f"{where}: MISMATCH in {', '.join(bad) or 'rank shards'}"
    return None
