"""Reinforcement learning over the shared model, by concern:

- `algo`: the method's math (group advantages, policy losses, AQN noise, response log-probabilities);
- `task`: what is learned (problems, prompts, rewards, answer grading);
- `loop`: running it (the trainer and its config, data order, checkpoints, metrics, data-parallel
  ranks, accuracy through the engine).

The jobs that train or evaluate a model in a work directory are `qerl_pipe.jobs`.
"""
