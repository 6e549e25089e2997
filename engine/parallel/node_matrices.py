"""Muon under model_sharding='node': each hidden matrix orthogonalized whole by one rank of its node.

FSDP2 cuts every parameter by rows over a node's G ranks (engine/parallel/sharding.py), and the
exchange across nodes hands rank (m, l) chunk m of its local buffer. LocalShards places each
hidden matrix's local rows in one chunk, the same on every rail (engine/core/flat.py
``_place_whole``), so the G ranks of node m together hold every row of the matrices in chunk m,
and after the rail's reduction each holds the node-summed, rail-reduced gradient of its rows.
Muon's momentum and its step are elementwise (acco_loco/muon.py), so they stay on the rows; only
Newton-Schulz needs the whole matrix. Each round that steps, before any piece goes out:

    every rank forms its rows' update (momentum, Nesterov) and sends them to the matrix's owner
    the owner (one of the node's G ranks, balanced by size: acco_loco/matrix_layout.py ``owners``)
    orthogonalizes the whole matrix with torch's Newton-Schulz
    the owner sends each rank the orthogonalized rows it holds; each rank steps its rows with them

Both legs are one torch.distributed all_to_all_single (uneven splits) on the comm thread's node
group. The rows travel in bfloat16: torch's Newton-Schulz casts its input to bfloat16 first and
returns bfloat16 (acco_loco/muon.py NS_INPUT_DTYPE), so the owner computes the same bits as on a
flat layout's whole matrix. Cost on the node link, per round that steps: each matrix of the
node's chunk crosses it twice except the owner's own rows, 2 x 2 B x (R - R_owner) x C, so about
4 B x (G - 1) / G per hidden-matrix value of the chunk, or 4 B x (G - 1) / (G M) of all the
hidden values per node (ACCO's two rounds a step: twice that). FSDP2 moves, per micro-batch, every
parameter twice (the forward's and the backward's all-gathers) and its fp32 gradient once over the
same link; the rail carries nothing more.
"""

from __future__ import annotations

import torch

from acco_loco import muon
from acco_loco.matrix_layout import owners

from .comm import Comm


def chunk_rows(rows: int, g: int, local: int) -> int:
    """The rows local rank ``local`` holds of a ``rows``-row parameter under FSDP2's Shard(0) cut
    over ``g`` ranks (torch.chunk's: ceil(rows / g) each, the last ones shorter or empty)."""
    each = -(-rows // g)
    return max(0, min(each, rows - local * each))


class NodeMatrices:
    """The hidden matrices of this node's chunk: who owns each, every rank's rows of it, and the
    round's orthogonalized rows of this rank (``orthogonal``). ``matrices``: this rank's
    (start in its shard, local rows, cols, whole rows) of each (LocalShards.matrices_in), in the
    same order on every rank of the node."""

    def __init__(self, matrices: list[tuple[int, int, int, int]], comm: Comm, g: int, local: int):
        self.comm, self.g, self.local = comm, g, local
        if comm.world_size != g or comm.rank != local:
            raise RuntimeError(f"the node group has this rank at {comm.rank} of {comm.world_size}, the layout at local "
                               f"rank {local} of {g}: the exchange sends local rank j's rows to group rank j")
        self.rows_of = [[chunk_rows(whole, g, j) for j in range(g)] for _, _, _, whole in matrices]
        for (start, rows, _, whole), cut in zip(matrices, self.rows_of):
            if cut[local] != rows:
                raise RuntimeError(f"the matrix at {start} of the shard has {rows} local rows of {whole}, the engine "
                                   f"expected {cut[local]} (torch.chunk's cut of dim 0 over {g} ranks)")
        self.owner = owners([whole * cols for _, _, cols, whole in matrices], g)
        # what the optimizer steps: this rank's rows of each matrix, their update from here
        self.blocks = [muon.MatrixRows(start, rows, cols, whole, self) for start, rows, cols, whole in matrices]
        self._orthogonal: dict[int, torch.Tensor] = {}

    def orthogonalize(self, state, grad_sum: torch.Tensor, count: int, coef: float, spec) -> None:
        """This round's orthogonalized rows of every matrix, from the state's momentum and the
        step's gradient (``grad_sum / count``, scaled by ``coef`` below 1: the optimizer's own).
        Every rank of the node calls it in the same round, before the round's pieces go out."""
        self._orthogonal.clear()
        if not self.blocks:  # no matrix in this node's chunk (so on every rank of the node)
            return
        g, mine = self.g, [i for i, o in enumerate(self.owner) if o == self.local]
        by_owner: list[list[torch.Tensor]] = [[] for _ in range(g)]
        for i, b in enumerate(self.blocks):
            if b.rows:
                lo, hi = b.start, b.start + b.rows * b.cols
                grad = grad_sum[lo:hi] / count
                if coef < 1.0:
                    grad.mul_(coef)
                _, update = muon.momentum_update(state.exp_avg[lo:hi], grad.to(torch.float32).view(b.rows, b.cols),
                                                 spec)
                by_owner[self.owner[i]].append(update.reshape(-1).to(muon.NS_INPUT_DTYPE))
        sent = [sum(t.numel() for t in part) for part in by_owner]
        taken = [sum(self.rows_of[i][j] * self.blocks[i].cols for i in mine) for j in range(g)]
        got = self.comm.all_to_all_split(_joined(by_owner, grad_sum.device), sent, taken)
        # each owned matrix whole (sender j's part: its rows of each, in order), orthogonalized
        wholes = {i: torch.empty(self.blocks[i].whole_rows, self.blocks[i].cols, dtype=got.dtype, device=got.device)
                  for i in mine}
        at = 0
        for j in range(g):
            for i in mine:
                first, n = sum(self.rows_of[i][:j]), self.rows_of[i][j] * self.blocks[i].cols
                wholes[i][first:first + self.rows_of[i][j]].view(-1).copy_(got[at:at + n])
                at += n
        done = {i: muon.orthogonalize(wholes[i], spec) for i in mine}
        back: list[list[torch.Tensor]] = [[] for _ in range(g)]
        for j in range(g):
            for i in mine:
                first = sum(self.rows_of[i][:j])
                back[j].append(done[i][first:first + self.rows_of[i][j]].reshape(-1))
        returned = self.comm.all_to_all_split(_joined(back, grad_sum.device, muon.NS_INPUT_DTYPE), taken, sent)
        at = 0
        for o in range(g):
            for i, b in enumerate(self.blocks):
                if self.owner[i] == o and b.rows:
                    n = b.rows * b.cols
                    self._orthogonal[b.start] = returned[at:at + n].view(b.rows, b.cols)
                    at += n

    def orthogonal(self, start: int) -> torch.Tensor:
        """This round's orthogonalized update of this rank's rows of the matrix at ``start``."""
        got = self._orthogonal.get(start)
        if got is None:
            raise RuntimeError(f"no orthogonalized update for the matrix at {start} of the shard: under "
                               "model_sharding='node' a Muon step needs NodeMatrices.orthogonalize first, in the round")
        return got


def _joined(parts: list[list[torch.Tensor]], device: torch.device,
            dtype: torch.dtype = muon.NS_INPUT_DTYPE) -> torch.Tensor:
    flat = [t for part in parts for t in part]
    return torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
