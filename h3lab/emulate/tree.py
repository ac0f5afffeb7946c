"""Reduction trees: a fixed order of FP32 additions over a row, its sum, and how a probe reveals it.

A tree is a leaf index (int) or a pair (left, right) of trees; its sum adds each pair once, in FP32
(one IEEE addition per node, so the order is the whole of the arithmetic). Triton's tl.sum over a
tile axis follows such a tree, fixed by the tile's layout (each thread's elements in register
order, then butterfly shuffles across lanes, then warps); `tree_probe` (h3lab.bench) reads it off
the GPU for the kernels' own layouts instead of assuming it.

How the probe reveals a tree (the idea of FPRev, Xie et al. 2024): for each pair of leaves i < j a
row holds +2^40 at i, -2^40 at j and 1.0 elsewhere. A one added to a partial sum that holds +-2^40
is absorbed (2^40 + 127 rounds back to 2^40 in FP32), the two big values cancel exactly where their
paths meet, and every one outside that subtree survives: the row sums to n - size(lca(i, j)).
Those sizes determine the tree (`tree_from_lca_sizes`); a node's two children are unordered, as
FP32 addition commutes.

The kernels' trees, as the H200 answered them (h3lab.bench.tree_probe): `wgmma_row_tree`
(attention_fwd's row sums) and `blocked_row_tree` with `contracted_sum` (attention_delta).

Dimension legend: R rows, N leaves (the reduced axis).
"""

from __future__ import annotations

import torch
from torch import Tensor

from h3lab.emulate.fma import fma_f32

Tree = int | tuple["Tree", "Tree"]
BIG = 2.0**40  # absorbs up to 2^16 ones: ulp(2^40) in FP32 is 2^17


def leaves(tree: Tree) -> list[int]:
    return [tree] if isinstance(tree, int) else leaves(tree[0]) + leaves(tree[1])


def tree_sum(x_RN: Tensor, tree: Tree) -> Tensor:
    """FP32 [R]: the sum of each row of x over the tree's leaves, one FP32 addition per node."""
    if isinstance(tree, int):
        return x_RN[:, tree].to(torch.float32)
    return tree_sum(x_RN, tree[0]) + tree_sum(x_RN, tree[1])


def chain_tree(indices: list[int]) -> Tree:
    """The left-to-right chain ((i0 + i1) + i2) + ... as a tree."""
    tree: Tree = indices[0]
    for i in indices[1:]:
        tree = (tree, i)
    return tree


def butterfly(parts: list[Tree]) -> Tree:
    """tl.sum's step across the threads that share a row: parts[t] is thread t's partial sum (2^k of
    them), combined by xor shuffles with the largest distance first (t with t ^ d, d = 2^(k-1) .. 1)."""
    if not parts or len(parts) & (len(parts) - 1):
        raise ValueError(f"butterfly over {len(parts)} threads; allowed: a power of two")
    while len(parts) > 1:
        d = len(parts) // 2
        parts = [(parts[t], parts[t + d]) for t in range(d)]
    return parts[0]


def wgmma_row_tree(n: int) -> Tree:
    """attention_fwd's tl.sum(p, 1) over a row of a wgmma accumulator tile of n columns (BLOCK_N, a
    multiple of 8): lane q of the row's quad holds columns 8k + 2q and 8k + 2q + 1 and adds them in
    register order (k ascending), then the quad's butterfly. Read off the H200 (tree_probe) at the
    pinned tiles, BLOCK_N 32 (head_dim 32) and 128 (head_dim 128); the Gluon forward of head_dim 128
    (h3lab.triton.attention_fwd_sm90) gives the Triton kernel's bytes, so it adds in this tree too."""
    if n % 8:
        raise ValueError(f"a wgmma row of {n} columns; allowed: a multiple of 8")
    return butterfly([chain_tree([8 * k + 2 * q + i for k in range(n // 8) for i in (0, 1)]) for q in range(4)])


def blocked_row_tree(n: int, per_thread: int = 8) -> Tree:
    """attention_delta's tl.sum(dO * O, 1) over a row of its [BLOCK_R, head_dim] tile (dO bf16, O FP32):
    thread t holds elements [t * per_thread, (t + 1) * per_thread) and chains them, then the butterfly
    over the row's n / per_thread threads. Read off the H200 at head_dim 32 and 128 (per_thread 8)."""
    if n % per_thread or (n // per_thread) & (n // per_thread - 1):
        raise ValueError(f"a row of {n} over {per_thread} per thread; allowed: n / per_thread a power of two")
    return butterfly([chain_tree(list(range(t * per_thread, (t + 1) * per_thread))) for t in range(n // per_thread)])


def contracted_sum(x_RN: Tensor, y_RN: Tensor, tree: Tree) -> Tensor:
    """FP32 [R]: the sum of x * y over the tree as LLVM contracts it (attention_delta: its FP32 products
    fused into the adds that take them; the H200 gave these bits at head_dim 32 and 128). A node of a
    subtree and leaf i is fma(x_i, y_i, subtree); a node of two leaves i, j (i the left, the thread's
    earlier element) is fma(x_i, y_i, x_j * y_j rounded); a node of two subtrees is an FP32 add; a
    tree of one leaf is the rounded product. x, y: FP32 (or converted to it exactly)."""
    x, y = x_RN.to(torch.float32), y_RN.to(torch.float32)

    def node(t: Tree) -> Tensor:
        if isinstance(t, int):
            return (x[:, t].double() * y[:, t].double()).float()  # the exact product, rounded once
        left, right = t
        if isinstance(right, int) and not isinstance(left, int):
            return fma_f32(x[:, right], y[:, right], node(left))
        if isinstance(left, int):
            return fma_f32(x[:, left], y[:, left], node(right))
        return node(left) + node(right)

    return node(tree)


def probe_rows(n: int) -> tuple[Tensor, list[tuple[int, int]]]:
    """FP32 [n(n-1)/2, n] probe rows (module docstring) and the pair (i, j) of each row."""
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    x = torch.ones((len(pairs), n), dtype=torch.float32)
    rows = torch.arange(len(pairs))
    x[rows, torch.tensor([i for i, _ in pairs])] = BIG
    x[rows, torch.tensor([j for _, j in pairs])] = -BIG
    return x, pairs


def lca_sizes(sums_R: Tensor, pairs: list[tuple[int, int]], n: int) -> dict[tuple[int, int], int]:
    """{(i, j): size of the subtree where leaves i and j meet}, from the probe rows' sums."""
    out = {}
    for (i, j), s in zip(pairs, sums_R.tolist(), strict=True):
        size = n - int(s)
        if s != int(s) or not 2 <= size <= n:
            raise ValueError(f"probe row ({i}, {j}) summed to {s}; allowed: n - size with 2 <= size <= {n}")
        out[(i, j)] = size
    return out


def tree_from_lca_sizes(sizes: dict[tuple[int, int], int], group: list[int] | None = None) -> Tree:
    """The tree whose pairs meet in subtrees of these sizes. Raises ValueError when no tree has them."""
    group = sorted({i for pair in sizes for i in pair}) if group is None else group
    if len(group) == 1:
        return group[0]
    first = group[0]
    size = lambda i, j: sizes[(min(i, j), max(i, j))]  # noqa: E731
    with_first = [first] + [j for j in group[1:] if size(first, j) < len(group)]
    rest = [j for j in group if j not in with_first]
    if not rest or any(size(i, j) != len(group) for i in with_first for j in rest):
        raise ValueError(f"the sizes over leaves {group} fit no binary tree (a node of {len(group)} leaves)")
    return (tree_from_lca_sizes(sizes, with_first), tree_from_lca_sizes(sizes, rest))


def lca_size_table(tree: Tree) -> dict[tuple[int, int], int]:
    """{(i, j): size of the subtree where i and j meet} of a known tree (what a probe of it reads)."""
    if isinstance(tree, int):
        return {}
    left, right = leaves(tree[0]), leaves(tree[1])
    n = len(left) + len(right)
    out = lca_size_table(tree[0]) | lca_size_table(tree[1])
    out |= {(min(i, j), max(i, j)): n for i in left for j in right}
    return out


def same_tree(a: Tree, b: Tree) -> bool:
    """Equal up to the order of each node's children (FP32 addition commutes)."""
    return canonical(a) == canonical(b)


def canonical(tree: Tree) -> Tree:
    """The tree with each node's children ordered by their smallest leaf."""
    if isinstance(tree, int):
        return tree
    kids = sorted((canonical(tree[0]), canonical(tree[1])), key=lambda t: min(leaves(t)))
    return (kids[0], kids[1])
