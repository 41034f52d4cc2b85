"""Balancers: how a multi-task recipe weighs its tasks' losses, or combines their gradients (``model.balancer``).

A balancer is one file's class and one config (``configs/balancer/<name>.yaml``, ``_target_`` its class):
`protocol` (what a balancer is and one step of it), `weighting` (weights from the losses), `scalarized` (any
torchjd scalarizer: GLS, RLW, STCH, FAMO, IMTL-L), `gradients` (rules on the tasks' gradients: PCGrad, GradNorm,
IMTL, any torchjd aggregator — `torchjd_state` checkpoints a stateful one), `moving_average` (DB-MTL, MoCo),
`build` (made from its config, once, for the recipe's tasks). docs/balancers.md lists the 26 shipped configs.
The configured weights cᵢ (``model.tasks.<task>.weight``) multiply every balancer's weights, so a
weight of 0 keeps a task off whatever the balancer. Its parameters are in the recipe's optimizer,
its state in the checkpoint: a resumed run continues exactly.
"""

from multiloss.balancers.double_sampling import MoDo, SDMGrad
from multiloss.balancers.gradients import (
    IMTL,
    GradNorm,
    JacobianDescent,
    PCGrad,
    StatefulJacobianDescent,
    pcgrad,
    pcgrad_coefficients,
)
from multiloss.balancers.moving_average import DBMTL, MoCo
from multiloss.balancers.protocol import Balanced, Balancer, GradientBalancer, GramianRule, balance
from multiloss.balancers.scalarized import LogSum, Scalarized
from multiloss.balancers.weighting import DynamicWeightAverage, Fixed, Uncertainty, dwa_weights

__all__ = [
    "DBMTL",
    "IMTL",
    "Balanced",
    "Balancer",
    "DynamicWeightAverage",
    "Fixed",
    "GradNorm",
    "GradientBalancer",
    "GramianRule",
    "JacobianDescent",
    "LogSum",
    "MoCo",
    "MoDo",
    "PCGrad",
    "SDMGrad",
    "Scalarized",
    "StatefulJacobianDescent",
    "Uncertainty",
    "balance",
    "dwa_weights",
    "pcgrad",
    "pcgrad_coefficients",
]
