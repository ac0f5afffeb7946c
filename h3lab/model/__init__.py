"""The whole MiniMax-H3 transformer under the h3-parallel-v1 contract (forward and backward), chains and
trajectories.

- `ModelInputs`: one packed request, in diffusers' forward arguments (inputs.py); `model_inputs`: the
  H3 pipeline's packing of video, audio and text rows (packing.py).
- `ModelWeights`, `CheckpointWeights`, `SyntheticWeights`: parameters, one block at a time;
  `InMemoryWeights`: held in memory, updated in place by a trainer (weights.py).
- `embed` -> `run_blocks` -> `head`, composed by `transformer_forward` (transformer.py): the seam a layout drives.
- chain.py: forward through blocks A..B, backward in reverse (recomputing each block's forward).
- backward.py: `model_forward` then `model_backward`, every gradient of a trained depth; the parts'
  backwards beside their forwards (embed_grad.py, refiner_grad.py, head_grad.py).
- trajectory.py: rectified-flow Euler steps through the whole transformer.

May import: the core and io (checkpoints).
"""

from h3lab.model.embed import Embedded, embed, project_rows, text_stream, time_embedding, timestep_sinusoid
from h3lab.model.head import ModelOutput, head, norm_out_table, output_rows
from h3lab.model.inputs import ModelInputs
from h3lab.model.packing import model_inputs, row_timesteps, shuffle_rows
from h3lab.model.transformer import RowsShard, gather_sequence, run_blocks, transformer_forward
from h3lab.model.weights import CheckpointWeights, InMemoryWeights, ModelWeights, SyntheticWeights

__all__ = [
    "CheckpointWeights",
    "Embedded",
    "InMemoryWeights",
    "ModelInputs",
    "ModelOutput",
    "ModelWeights",
    "RowsShard",
    "SyntheticWeights",
    "embed",
    "gather_sequence",
    "head",
    "model_inputs",
    "norm_out_table",
    "output_rows",
    "project_rows",
    "row_timesteps",
    "run_blocks",
    "shuffle_rows",
    "text_stream",
    "time_embedding",
    "timestep_sinusoid",
    "transformer_forward",
]
