"""What the policy learns: problems and their data, prompts, rewards and answer grading."""
