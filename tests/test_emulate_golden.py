"""CI's check of the H200's bits: the tiny reference block, the golden trajectory and the training
gate (two Trainer steps of blocks 0-1) through the sm90 emulator, on this CPU, give the digests of
kernels/golden/sm90.json (recorded on an H200's triton backend). A kernel change that moves one GPU
bit of any makes this fail (or the set is re-recorded on a GPU); a model the emulation lacks raises
NotImplementedError, a failure too.
"""

from __future__ import annotations

import pytest

from h3lab.backend import EmulateSM90Backend
from h3lab.run import golden


@pytest.mark.parametrize("part", golden.EMULATED_PARTS)
def test_the_emulator_gives_the_h200s_digests(part):
    fn = {"block": golden.reference_digests, "trajectory": golden.trajectory_digests, "train": golden.train_digests}[
        part
    ]
    assert fn(EmulateSM90Backend(), "cpu") == golden.load_set("sm90")[part]
