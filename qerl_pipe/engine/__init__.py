"""The rollout engine: `Engine(model, limits).generate(prompts, n, SamplingParams(...)) -> Rollouts`.
Runs the trainer's own `Decoder` (no second model, no weight sync) over one preallocated KV cache;
`plan_limits` sizes it, `SamplingParams` sets the counter-based Gumbel-max sampling. See
docs/engine.md, section "The rollout engine (`qerl_pipe/engine/`)" (its file table and "API")."""

from qerl_pipe.engine.engine import Engine, PromptError, Rollouts
from qerl_pipe.engine.limits import EngineLimits, EngineLimitsError, kv_bytes_per_token, plan_limits
from qerl_pipe.engine.sampling import SamplingParams, SamplingParamsError

__all__ = ["Engine", "EngineLimits", "EngineLimitsError", "PromptError", "Rollouts", "SamplingParams",
           "SamplingParamsError", "kv_bytes_per_token", "plan_limits"]
