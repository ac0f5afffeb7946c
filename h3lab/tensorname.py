"""`TensorName`: the one grammar of the names a run gives its tensors, parsed and formatted here.

    [step{k}.][block{i}.]<body>[@u{u}]

- `step{k}.`: a tensor of training step k (or of sampler step k of a trajectory);
- `block{i}.`: block i's, in a chain or a trained depth;
- `<body>`: what it is: `out`, `dx`, `dtemb`, `loss`, `loss.video`, `grad_norm`, `clip_coef`,
  `video`, `audio`, `dw.<parameter or unit gradient>` (a gradient), `w.<...>` (a weight after a
  step's update), or a traced op (`attn.to_q`, `d.ff.net.2`, `embed.temb`...);
- `@u{u}`: canonical unit u's slice of a unit gradient or weight.
Producers: h3lab.run.tasks (block steps), h3lab.train (steps, pieces), the trace hooks; readers: the
runner's reassembly, the per-step verdicts (h3lab.run.steps), the trace's timeline, the report.
`str(TensorName.parse(name)) == name` for every name.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

_NUMBER = r"(?:0|[1-9]\d*)"  # no leading zeros: a number formats back to the digits it was read from
_NAME = re.compile(
    rf"^(?:step(?P<step>{_NUMBER})\.)?(?:block(?P<block>{_NUMBER})\.)?(?P<body>.+?)(?:@u(?P<unit>{_NUMBER}))?$",
    re.DOTALL,
)
GRAMMAR = "[step{k}.][block{i}.]<body>[@u{u}]"
KINDS = ("dw", "w")  # the bodies of gradients and of updated weights: `dw.<name>`, `w.<name>`


@dataclass(frozen=True)
class TensorName:
    body: str
    step: int | None = None
    block: int | None = None
    unit: int | None = None

    def __post_init__(self) -> None:
        if not self.body:
            raise ValueError(f"tensor name body {self.body!r}; allowed: a non-empty name ({GRAMMAR})")
        for field in ("step", "block", "unit"):
            v = getattr(self, field)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"tensor name {field}={v!r}; allowed: None or an int >= 0")

    @classmethod
    def parse(cls, name: str) -> TensorName:
        m = _NAME.match(name)
        if m is None:
            raise ValueError(f"tensor name {name!r}; allowed: {GRAMMAR}")
        number = lambda g: None if m[g] is None else int(m[g])  # noqa: E731
        return cls(m["body"], number("step"), number("block"), number("unit"))

    def __str__(self) -> str:
        step = "" if self.step is None else f"step{self.step}."
        block = "" if self.block is None else f"block{self.block}."
        return f"{step}{block}{self.body}" + ("" if self.unit is None else f"@u{self.unit}")

    @property
    def kind(self) -> str | None:
        """ "dw" for a gradient, "w" for an updated weight (the body's first part), else None."""
        head, dot, _ = self.body.partition(".")
        return head if dot and head in KINDS else None

    @property
    def param(self) -> str | None:
        """The parameter or unit gradient a `dw.`/`w.` body names (None for another body)."""
        return self.body.split(".", 1)[1] if self.kind is not None else None

    @property
    def unit_slice(self) -> bool:
        """One canonical unit's slice of a gradient or weight (`...dw.<unit gradient>@u{u}`)."""
        return self.unit is not None and self.kind is not None

    def replace(self, **changes: object) -> TensorName:
        return dataclasses.replace(self, **changes)
