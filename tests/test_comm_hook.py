"""DistComm's `on_call` hook: what a rank's status file and a test's faults see of the collectives,
without a process group (the collectives here only hand back their input, as a member of one would)."""

from __future__ import annotations

import signal

import torch

from h3lab.parallel.distcomm import DistComm
from h3lab.parallel.layout import Layout
from h3lab.run.progress import Progress
from h3lab.run.workers import faults


class _Echo:
    """A collective of two members that hands back its input (the bytes a real one moves don't matter here)."""

    def __init__(self) -> None:
        self.members = [0, 1]

    def all_reduce(self, x, site, *, then=None):
        return then(x) if then is not None else x

    reduce_scatter = all_reduce

    def start_all_reduce(self, x, site, *, then=None):
        return lambda: self.all_reduce(x, site, then=then)

    def all_gather(self, x, site, dim=0, sizes=None):
        return torch.cat([x, x], dim=dim)

    def close(self) -> None:
        pass


def _comm(on_call=None) -> DistComm:
    return DistComm(Layout.parse("tp2xcp2+sp"), 0, _Echo(), _Echo(), on_call)


def test_the_hook_sees_every_collective_site_in_call_order():
    sites: list[str] = []
    comm = _comm(sites.append)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    comm.reduce_units(x, "attn.to_out.0", scatter_rows=True)
    comm.start_reduce_units(x, "ff.net.2")()
    comm.gather_units(x, "clip", dim=0)
    comm.gather_tp_rows(x, "sp.gather.m1")
    comm.gather_seq_rows(x, "cp.kv")
    assert sites == ["attn.to_out.0", "ff.net.2", "clip", "sp.gather.m1", "cp.kv"]
    _comm().reduce_units(x, "no hook")  # without a hook nothing is called, the bytes are the same


def test_a_ranks_progress_counts_the_calls_into_its_status_file(tmp_path):
    progress = Progress(tmp_path / "rank0.status.json")
    comm = _comm(progress.tick)
    comm.gather_units(torch.randn(2, 2, generator=torch.Generator().manual_seed(1)), "site.a", dim=0)
    progress.close()
    assert (progress.calls, progress.site) == (1, "site.a")
    assert '"calls": 1, "site": "site.a"' in (tmp_path / "rank0.status.json").read_text()


def test_a_stop_fault_is_a_hook_that_stops_after_announcing_the_site(monkeypatch):
    seen, stops = [], []
    hook = seen.append
    monkeypatch.setenv(faults.FAULT_VAR, "stop:1")
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: stops.append(sig))
    assert faults.inject("0", hook) is hook  # aimed at another rank: the hook unchanged
    comm = _comm(faults.inject("1", hook))
    assert stops == []  # nothing stops before the next collective
    comm.gather_units(torch.randn(2, 2, generator=torch.Generator().manual_seed(2)), "site.b", dim=0)
    assert seen == ["site.b"] and stops == [signal.SIGSTOP]
