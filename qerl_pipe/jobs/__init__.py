"""Jobs the stages call: one training run (`train_job`) or one evaluation (`eval_job`) in a
directory, from the recipe's sections to the files the stage seals as its artifact."""
