"""The RL method's math: group advantages, GRPO/DAPO/Dr. GRPO losses, AQN noise, response log-probabilities."""
