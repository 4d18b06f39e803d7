"""GPU memory of a RL step: the step model (`step`: what a step's settings ask for, estimated from
the config) and the planner (`plan`: the largest settings whose estimate fits a budget)."""

from qerl_pipe.memory.plan import (GB, MemoryBudgetError, MemoryPlan, StepShape, candidates, enforce_budget,
                                   plan_step, plan_train, release_budget, step_budget, train_step_shape)
from qerl_pipe.memory.step import StepSize, estimate_step_bytes

__all__ = ["GB", "MemoryBudgetError", "MemoryPlan", "StepShape", "StepSize", "candidates", "enforce_budget",
           "estimate_step_bytes", "plan_step", "plan_train", "release_budget", "step_budget", "train_step_shape"]
