"""The ``fsdp-plus-train`` application: a Hydra app around the strategy (train, data, LM module, generation,
metrics, sweep summaries, structured configs). Importing this package imports nothing heavy; its modules
import Hydra, ``datasets`` and matplotlib where they need them."""
