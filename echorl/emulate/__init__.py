"""The swarm at scale, emulated: the real broker with hundreds of emulated samplers and an
emulated trainer on GPU-speed profiles and wide-area links (`profiles.toml`, each figure
with its source). `links.py` is the flow-level network model, `swarm.py` the samplers, the
trainer and a run; `bench/scale.py` sweeps them."""
