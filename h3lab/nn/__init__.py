"""Your own PyTorch code on diffusers' MiniMax-H3 model, under h3lab's contract.

- `parallelize(model, layout)` (apply.py): diffusers' `MiniMaxH3Transformer3DModel` made
  deterministic in place: diffusers' forward, autograd through h3lab's backward (function.py), each
  rank holding its units' shards of the block weights (state.py); diffusers' arguments as h3lab's
  request (inputs.py); `full_state_dict` (full.py) the whole parameters back.
- `flow_matching_loss` (losses.py): h3lab's rectified-flow objective as an autograd loss.
- `record`, `current_layout` (recording.py): what a script reports to `h3lab compare`, and its layout.

May import: the core, io, model, dist, train.
"""

from h3lab.nn.apply import parallelize
from h3lab.nn.full import full_state_dict
from h3lab.nn.inputs import diffusers_kwargs
from h3lab.nn.losses import flow_matching_loss
from h3lab.nn.recording import current_layout, record

__all__ = ["current_layout", "diffusers_kwargs", "flow_matching_loss", "full_state_dict", "parallelize", "record"]
