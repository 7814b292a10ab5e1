"""A step's model FLOPs and the model FLOPs utilization (MFU), by the formula of
``tools/sim/simulate_cluster.py``: ``6 N T`` for the matmuls (``N`` the parameters a token meets in one:
the transformer blocks and the LM head, not the input embedding's lookup; ``T`` the real tokens)
plus ``6 layers hidden sum(L^2)`` for the attention of varlen-packed samples (each sample attends to
itself: PaLM's ``12 layers hidden L^2``, halved for causal kernels that skip the masked triangle).
A vision tower's patches are not counted. Standard library only."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FlopsModel", "step_flops"]


def step_flops(*, matmul_params: int, layers: int, hidden: int, tokens: int, attn_area: int) -> float:
    """The model FLOPs of a forward and backward over ``tokens`` real tokens whose samples' squared
    lengths sum to ``attn_area``."""
    return 6.0 * matmul_params * tokens + 6.0 * layers * hidden * attn_area


@dataclass(frozen=True)
class FlopsModel:
    """What :func:`step_flops` needs of the model, and one device's peak FLOP/s in the training
    precision (None where odb does not know it: no MFU then)."""

    matmul_params: int
    layers: int
    hidden: int
    peak_flops: float | None

    def mfu(self, *, tokens: int, attn_area: int, seconds: float, world_size: int) -> float | None:
        """The step's model FLOPs over what ``world_size`` devices could do in ``seconds``."""
        if not self.peak_flops or seconds <= 0:
            return None
        flops = step_flops(matmul_params=self.matmul_params, layers=self.layers, hidden=self.hidden, tokens=tokens,
                           attn_area=attn_area)
        return flops / (seconds * world_size * self.peak_flops)
