"""GPU memory of a RL step: the step model (`step`: what a step's settings ask for, estimated from
the config) and the planner (`plan`: the largest settings whose estimate fits a budget). Both take
plain numbers; `jobs.step_plan` turns a recipe's sections into them."""

from qerl_pipe.memory.plan import (GB, MemoryBudgetError, MemoryPlan, PlanChange, StepShape, budget_cap, candidates,
                                   enforce_budget, plan_step, release_budget, step_budget)
from qerl_pipe.memory.step import StepSize, estimate_step_bytes

__all__ = ["GB", "MemoryBudgetError", "MemoryPlan", "PlanChange", "StepShape", "StepSize", "budget_cap", "candidates",
           "enforce_budget", "estimate_step_bytes", "plan_step", "release_budget", "step_budget"]
