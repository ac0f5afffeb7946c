"""`Variant`: one build of a kernel as its launcher asks for it under a node type's pinned file.

Each kernel module exports `variants(node) -> list[Variant]`, every build its launcher can ask of
kernels/<node>.json; h3lab.bench.compile_pinned finds them and compiles each for the node's GPU
without one. A variant names the kernel's arguments the way a launch passes them:
- `types`: a runtime argument's type ("*bf16", "fp32", "tensordesc<bf16[64, 64]>"), a tuple of
  them for a tuple argument, None for a None (a constexpr); an argument it does not name is "i32";
- `const`: the constexpr arguments' values.
Pointers are taken as 16-byte aligned, as the runtime finds torch's allocations (unless
`align_pointers` is off), and so are the integers named in `aligned` (every element of a tuple).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ALIGNED = [["tt.divisibility", 16]]
# The attention kernels' pinned bits contract multiplies and adds into FMAs where Triton's compiler
# does (h3lab.bench.ptx_audit lists the sites, h3lab.emulate.attention models them): FMA fusion on,
# named at every launch and build rather than left to Triton's default, which a release may change.
# Every other kernel launches with it off (`options`).
ATTENTION_FP_FUSION = True


@dataclass(frozen=True)
class Variant:
    """One kernel build: the pinned entry it reads, which call, the jit function, argument types,
    constexprs, launch options."""

    kernel: str  # the pinned entry it reads
    what: str  # which call or bucket
    fn: Any  # the @triton.jit or @gluon.jit function
    types: dict[str, Any] = field(default_factory=dict)
    const: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    aligned: tuple[str, ...] = ()  # integer arguments taken as multiples of 16 too
    align_pointers: bool = True

    @property
    def function(self) -> str:
        """`module.name` of the jit function under h3lab.triton."""
        return f"{self.fn.fn.__module__.removeprefix('h3lab.triton.')}.{self.fn.fn.__name__}"

    def signature(self) -> tuple[dict[str, Any], dict[tuple[int, ...], Any], dict[tuple[int, ...], Any]]:
        """(signature, constexprs, attrs) for triton.compile's ASTSource, keyed as a launch keys them:
        tuple elements by their path (argument index, element index, ...)."""
        sig: dict[str, Any] = {}
        constexprs: dict[tuple[int, ...], Any] = {}
        attrs: dict[tuple[int, ...], Any] = {}

        def walk(t: Any, path: tuple[int, ...], aligned: bool) -> Any:
            if isinstance(t, tuple):
                return tuple(walk(e, (*path, j), aligned) for j, e in enumerate(t))
            if t is None:
                constexprs[path] = None
                return "constexpr"
            if (t.startswith("*") and self.align_pointers) or aligned:
                attrs[path] = ALIGNED
            return t

        for i, name in enumerate(self.fn.arg_names):
            if name in self.const:
                sig[name] = "constexpr"
                constexprs[(i,)] = self.const[name]
            else:
                sig[name] = walk(self.types.get(name, "i32"), (i,), name in self.aligned)
        return sig, constexprs, attrs


def options(cfg: dict[str, Any], stages: bool = True) -> dict[str, Any]:
    """A pinned entry's launch options: its warps (and stages), FP fusion off as every launcher but
    attention's has it (ATTENTION_FP_FUSION)."""
    return {"num_warps": cfg["num_warps"], "enable_fp_fusion": False} | (
        {"num_stages": cfg["num_stages"]} if stages else {}
    )
