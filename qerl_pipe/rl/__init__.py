"""Reinforcement learning over the shared model: advantages, policy losses, AQN schedules."""
