"""The rollout engine: `Engine(model, limits).generate(prompts, n, SamplingParams(...)) -> Rollouts`.

- `limits`: `EngineLimits`, `plan_limits` (how many slots, how long, which CUDA-graph sizes)
- `sampling`: `SamplingParams`, counter-based Gumbel-max sampling
- `graphs`: the decode step, eager or replayed from CUDA graphs
- `scheduler`: `Scheduler`, the queue and slot table (admission, compaction, release)
- `engine`: `Engine`, `Rollouts`: applies the scheduler's answers to the KV cache and runs the model

See docs/engine.md.
"""

from qerl_pipe.engine.engine import Engine, PromptError, Rollouts
from qerl_pipe.engine.limits import EngineLimits, EngineLimitsError, kv_bytes_per_token, plan_limits
from qerl_pipe.engine.sampling import SamplingParams, SamplingParamsError

__all__ = [
    "Engine",
    "EngineLimits",
    "EngineLimitsError",
    "PromptError",
    "Rollouts",
    "SamplingParams",
    "SamplingParamsError",
    "kv_bytes_per_token",
    "plan_limits",
]
