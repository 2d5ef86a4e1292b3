"""The PCP collectives: all-gather of per-rank row counts known in advance, padded to the largest."""

from __future__ import annotations

import torch
import torch.distributed as dist


class PendingGather:
    """An all-gather in flight (``wait()`` returns its result; NCCL: the compute stream waits, not the host)."""

    def __init__(self, out: torch.Tensor, work: dist.Work | None, keep: torch.Tensor | None = None) -> None:
        self._out = out
        self._work = work
        self._keep = keep  # the send buffer stays alive until the collective is done

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._keep = None
        return self._out


def start_gather(x: torch.Tensor, counts: list[int], group: dist.ProcessGroup | None) -> PendingGather:
    """Start an all-gather of rows of ``x`` (this rank holds ``x.shape[0]`` of them) over a PCP group.

    Every rank knows every rank's count (``counts``), so no sizes are exchanged: each pads to
    ``m = max(counts)`` rows and the result is ``[len(counts) · m, ...]``, rank ``i``'s rows at
    ``[i·m, i·m + counts[i])`` (the rest padding). With one rank, ``x`` itself.
    """
    if len(counts) == 1:
        return PendingGather(x, None)
    m = max(counts)
    out = x.new_empty((len(counts) * m, *x.shape[1:]))
    if m == 0:
        return PendingGather(out, None)
    padded = x if x.shape[0] == m else torch.cat((x, x.new_zeros((m - x.shape[0], *x.shape[1:]))))
    padded = padded.contiguous()
    if dist.get_backend(group) == "nccl":
        work = dist.all_gather_into_tensor(out, padded, group=group, async_op=True)
    else:
        work = dist.all_gather(list(out.chunk(len(counts))), padded, group=group, async_op=True)
    return PendingGather(out, work, padded)


def gather_padded(x: torch.Tensor, counts: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """:func:`start_gather`, waited for."""
    return start_gather(x, counts, group).wait()


def padded_index(per_rank: list[torch.Tensor], counts: list[int], numel: int) -> torch.Tensor:
    """Inverse map for :func:`gather_padded`: ``per_rank[i][k]`` is the destination of rank i's row k.

    Returns ``idx`` [numel] with ``gathered[idx]`` in destination order.
    """
    stride = max(counts) if len(counts) > 1 else 0
    idx = torch.empty(numel, dtype=torch.long)
    for i, dst in enumerate(per_rank):
        idx[dst] = i * stride + torch.arange(dst.numel())
    return idx
