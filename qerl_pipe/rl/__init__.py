"""Reinforcement learning over the shared model, by concern: `algo` (the method's math), `task` (what
is learned: problems, prompts, rewards, grading), `loop` (the trainer, checkpoints, ranks, metrics).
`algo` and `task` import neither each other nor `loop`; the jobs that run them are `qerl_pipe.jobs`.
See docs/architecture.md, section "Where each kind of change goes"."""
