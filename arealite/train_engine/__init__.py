"""The train engine: FSDP2 forward, backward and optimizer steps on packed micro-batches,
checkpoints and weight export, for any loss it is given (`arealite.api.contracts.TrainEngine`).
It knows nothing of RL, HTTP or the inference servers."""
