"""The PCP collectives: all-gather of per-rank row counts known in advance, padded to the largest."""

from __future__ import annotations

import torch
import torch.distributed as dist


def gather_padded(x: torch.Tensor, counts: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather rows of ``x`` (this rank holds ``x.shape[0]`` of them) over a PCP group.

    Every rank knows every rank's count (``counts``), so no sizes are exchanged: each pads to
    ``m = max(counts)`` rows and the result is ``[len(counts) · m, ...]``, rank ``i``'s rows at
    ``[i·m, i·m + counts[i])`` (the rest padding). With one rank, ``x`` itself.
    """
    if len(counts) == 1:
        return x
    m = max(counts)
    padded = x.new_zeros((m, *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = x.new_empty((len(counts) * m, *x.shape[1:]))
    if m == 0:
        return out
    if dist.get_backend(group) == "nccl":
        dist.all_gather_into_tensor(out, padded, group=group)
    else:
        dist.all_gather(list(out.chunk(len(counts))), padded, group=group)
    return out


def padded_index(per_rank: list[torch.Tensor], counts: list[int], numel: int) -> torch.Tensor:
    """Inverse map for :func:`gather_padded`: ``per_rank[i][k]`` is the destination of rank i's row k.

    Returns ``idx`` [numel] with ``gathered[idx]`` in destination order.
    """
    stride = max(counts) if len(counts) > 1 else 0
    idx = torch.empty(numel, dtype=torch.long)
    for i, dst in enumerate(per_rank):
        idx[dst] = i * stride + torch.arange(dst.numel())
    return idx
