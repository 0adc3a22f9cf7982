"""What the sampler and the trainer both do with a policy: generate and score groups
(`generate`, `hf`, `scoring`) and evaluate it (`evaluate`). Below both roles: neither
`echorl.sampler` nor `echorl.trainer` is imported here. `scoring` needs no torch (the
broker re-scores with it)."""
