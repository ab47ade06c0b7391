"""Will it fit, and how fast: the memory of every trainer rank and server, and the run's
throughput, predicted from the config and the model's config.json before anything starts
(`python -m arealite.plan`)."""
